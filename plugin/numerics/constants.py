"""Format constants, each with its meaning. Every op and scheme reads its magic numbers from here."""

# FP8 E4M3 (the "fn" variant: no infinities, one NaN pattern per sign, max finite 448 = 1.75 * 2^8).
F8E4M3_MAX = 448.0
F8E4M3_EMAX = 8  # exponent of the largest power of two <= F8E4M3_MAX

# Dynamic per-token / per-tensor activation scales are clamped below by this, so an all-zero row gets
# a finite scale (and zeros out) instead of 0/0 = NaN. Same floor as vLLM's scaled_fp8_quant.
FP8_MIN_SCALE = 1.0 / (F8E4M3_MAX * 512.0)

# FP4 E2M1: 1 sign, 2 exponent, 1 mantissa bit; 8 magnitudes, max 6 = 1.5 * 2^2.
F4E2M1_MAX = 6.0
F4E2M1_EMAX = 2
# Magnitude of each 3-bit code (the sign is bit 3 of the nibble).
F4E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# E8M0 (UE8M0) shared scale of the OCP MX formats: an unsigned biased exponent, value 2^(code - 127);
# code 255 is NaN. No sign, no mantissa.
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_EXP = -127  # code 0
E8M0_MAX_EXP = 127  # code 254

# MX block size (elements sharing one E8M0 scale, contiguous along K) and NVFP4 block size
# (elements sharing one E4M3 scale, plus one fp32 global scale per tensor).
MX_BLOCK = 32
NVFP4_BLOCK = 16

# int4 weights: 8 values per int32, value j of a word in bits [4j, 4j+4) (little-endian nibbles).
INT4_PER_INT32 = 8
INT4_SYM_QMIN, INT4_SYM_QMAX = -8, 7  # symmetric: stored as q + 8 in [0, 15]
INT4_ASYM_QMAX = 15  # asymmetric: stored as q in [0, 15] with a zero point in [0, 15]
INT4_SYM_OFFSET = 8
W4A16_GROUP_SIZES = (32, 64, 128, -1)  # -1: one group per output channel (per-channel scales)

# Smallest weight scale written for any scheme: all-zero rows (the padded model has them) must not get
# a zero scale, which would turn their dequantized weights into 0 * inf = NaN on the way back.
MIN_WEIGHT_SCALE = 1e-12
