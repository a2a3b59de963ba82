"""cublade.extension and the extension load in cublade.ops._dispatch, on a CPU machine: a GPU the kernels target
(sm_90) is mocked, and torch.utils.cpp_extension.load is replaced by a fake that records its arguments."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.utils.cpp_extension
from filelock import FileLock

from cublade import extension
from cublade.ops import _dispatch


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    """An sm_90 GPU with no installed extension, a toolchain, and a cache under tmp_path; yields the build calls."""
    monkeypatch.setenv("CUBLADE_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CUBLADE_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(extension, "gpu_capability", lambda: (9, 0))
    monkeypatch.setattr(extension, "_toolchain_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "cublade._C", None)  # `from cublade import _C` fails
    builds, loaded = [], []

    def fake_load(**kw):
        builds.append(kw)
        (tmp_path / "cache" / extension.cache_key() / extension.LIBRARY).write_bytes(b"")
        return kw["build_directory"]

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(path))
    # _load sets these module globals: restore them afterwards
    for name in ("_LOAD_ERROR", "_LOADED_FROM", "_CUDA_OPS"):
        monkeypatch.setattr(_dispatch, name, getattr(_dispatch, name))
    return builds, loaded


def test_missing_extension_on_sm90_is_built_into_the_cache_with_setup_flags(hopper, capsys, tmp_path):
    builds, loaded = hopper
    assert _dispatch._load() is True
    (kw,) = builds
    d = tmp_path / "cache" / extension.cache_key()
    assert kw["build_directory"] == str(d)
    assert extension.ARCH_FLAG in kw["extra_cuda_cflags"] and "--expt-relaxed-constexpr" in kw["extra_cuda_cflags"]
    assert not any("fast" in f for f in kw["extra_cuda_cflags"] + kw["extra_cflags"])
    assert {p.rsplit("/", 1)[-1] for p in kw["sources"]} >= {"bindings.cpp", "w4a16_gemm.cu"}
    assert loaded == [str(d / extension.LIBRARY)] and _dispatch._LOADED_FROM == str(d / extension.LIBRARY)
    assert (d / "build.lock").exists()
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("cublade: building the CUDA extension for sm_90a into " + str(d)) and "minutes"
               in line for line in err)


def test_cached_build_is_loaded_without_a_toolchain(hopper, monkeypatch):
    builds, loaded = hopper
    _dispatch._load()
    monkeypatch.setattr(extension, "_toolchain_problem", lambda: "nvcc not found")
    assert _dispatch._load() is True
    assert len(builds) == 1 and len(loaded) == 2


def test_no_toolchain_stops_with_one_line_naming_the_fix(hopper, monkeypatch):
    builds, _ = hopper
    monkeypatch.setattr(extension, "_toolchain_problem", lambda: "nvcc not found (no CUDA toolkit)")
    with pytest.raises(extension.ExtensionUnavailable) as e:
        _dispatch._load()
    msg = str(e.value)
    assert "\n" not in msg and "nvcc not found" in msg
    assert "scripts/build_wheel.sh" in msg and "CUBLADE_DISABLE_KERNELS=1" in msg
    assert builds == []


def test_toolchain_problem_names_nvcc(monkeypatch):
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(extension.shutil, "which", lambda name: None)
    assert extension._toolchain_problem().startswith("nvcc not found")
    monkeypatch.setattr(extension.shutil, "which", lambda name: "/usr/bin/nvcc" if name == "nvcc" else None)
    monkeypatch.setitem(sys.modules, "ninja", None)
    assert extension._toolchain_problem() == "ninja not found (pip install ninja)"


def test_compile_error_stops_with_one_line_and_keeps_the_log(hopper, monkeypatch, tmp_path):
    def failing_load(**kw):
        raise RuntimeError("Error building extension '_C'\nw4a16_gemm.cu(12): error: something\n2 errors")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_load)
    with pytest.raises(extension.ExtensionUnavailable) as e:
        _dispatch._load()
    msg = str(e.value)
    log = tmp_path / "cache" / extension.cache_key() / "build.log"
    assert "\n" not in msg and str(log) in msg and "Fix:" in msg
    assert "w4a16_gemm.cu(12): error" in log.read_text()


def test_references_on_sm90_need_the_explicit_opt_in(hopper, monkeypatch):
    builds, loaded = hopper
    monkeypatch.setenv("CUBLADE_DISABLE_KERNELS", "1")
    assert _dispatch._load() is False
    assert builds == [] and loaded == []


@pytest.mark.parametrize("cap", [None, (8, 9), (10, 0)])
def test_nothing_is_built_off_hopper(hopper, monkeypatch, cap):
    builds, loaded = hopper
    monkeypatch.setattr(extension, "gpu_capability", lambda: cap)
    assert _dispatch._load() is False
    assert builds == [] and loaded == [] and "_C" in _dispatch._LOAD_ERROR


def test_a_second_process_waits_for_the_build_lock_and_reuses_the_library(hopper, tmp_path):
    builds, _ = hopper
    d = tmp_path / "cache" / extension.cache_key()
    d.mkdir(parents=True)
    lock = FileLock(str(d / "build.lock"))
    lock.acquire()
    t = threading.Thread(target=extension._build, args=(d,))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and builds == []  # waiting for the lock
    (d / extension.LIBRARY).write_bytes(b"")  # what the holder built
    lock.release()
    t.join(10)
    assert not t.is_alive() and builds == []


def test_cache_key_names_torch_cuda_python_arch_and_the_sources(monkeypatch, tmp_path):
    key = extension.cache_key()
    assert key.startswith(f"torch{torch.__version__.replace('+', '-')}-cuda{torch.version.cuda}-"
                          f"py{sys.version_info.major}{sys.version_info.minor}-sm_90a-")
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "a.cu").write_text("x")
    monkeypatch.setattr(extension, "CSRC", src)
    k1 = extension.cache_key()
    (src / "a.cu").write_text("y")
    assert extension.cache_key() != k1
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "-cuda13.0-" in extension.cache_key()


def test_cache_root_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CUBLADE_EXT_CACHE", str(tmp_path / "x"))
    assert extension.cache_root() == tmp_path / "x"
    monkeypatch.delenv("CUBLADE_EXT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert extension.cache_root() == tmp_path / "xdg" / "cublade" / "ext"
