"""The compiled-kernel cache loads only a library this user alone could have put there.

A stand-in kernel source keeps compiling fast; a "planted" library writes a marker file from its
constructor, so loading it at all shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from steadfast.model import kernels, paged_attention

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"),
]

STAND_IN = "int paged_attention_supported(void) { return 0; }\n"
PLANTED = (
    "#include <stdio.h>\n"
    '__attribute__((constructor)) static void planted(void) { fclose(fopen(MARKER, "w")); }\n'
    "int paged_attention_supported(void) { return 0; }\n"
)


@pytest.fixture
def where(tmp_path, monkeypatch):
    """tmp_path, holding the user's kernel cache `cache/` and the temporary directory `tmp/`."""
    source = tmp_path / "kernel.c"
    source.write_text(STAND_IN)
    monkeypatch.setattr(paged_attention, "SOURCE", source)
    monkeypatch.setenv("STEADFAST_KERNEL_DIR", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    # The stand-in compiles on any CPU; the real kernels are not even built without AVX-512F.
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags\t\t: fpu sse2 avx2 avx512f avx512bw")
    return tmp_path


def plant(path, marker) -> None:
    source = path.with_suffix(".planted.c")
    source.write_text(PLANTED)
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(path), str(source)], check=True)


def fallback(where, name: str):
    return where / "tmp" / f"steadfast-kernels-{os.getuid()}" / name


def test_a_kernel_in_a_folder_others_can_write_is_not_loaded(where):
    cached = kernels.build(paged_attention.SOURCE, "decode attention")  # compiled into the user's cache, not loaded
    assert cached is not None and cached.parent == where / "cache"
    plant(cached, where / "marker")
    os.chmod(cached.parent, 0o777)
    assert paged_attention.load() is None  # the stand-in kernel: "no AVX-512"
    assert not (where / "marker").exists()
    assert fallback(where, cached.name).is_file()  # compiled again where only we can write


@pytest.mark.parametrize("how", ["writable by its group", "a symlink", "another user's"])
def test_a_kernel_file_not_ours_alone_is_not_loaded(where, how):
    cached = kernels.build(paged_attention.SOURCE, "decode attention")
    assert cached is not None and cached.parent == where / "cache"
    if how == "a symlink":
        elsewhere = where / "elsewhere.so"
        plant(elsewhere, where / "marker")
        cached.unlink()
        cached.symlink_to(elsewhere)
    else:
        plant(cached, where / "marker")
        if how == "writable by its group":
            os.chmod(cached, 0o775)
        elif os.geteuid() == 0:
            os.chown(cached, 12345, 12345)
        else:
            pytest.skip("only root can give a file away")
    assert paged_attention.load() is None
    assert not (where / "marker").exists()
    assert fallback(where, cached.name).is_file()


def test_without_avx512_no_kernel_is_compiled(where, monkeypatch):
    """Every kernel needs AVX-512F; most fail to compile without it, and a failed build is not cached: so
    none is built there at all (it cost ~2 s of compiler at every process start)."""
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags\t\t: fpu sse2 avx avx2 fma")

    def no_compiler(*args, **kwargs):
        raise AssertionError("nothing is compiled without AVX-512")

    monkeypatch.setattr(kernels, "build", no_compiler)
    assert paged_attention.load() is None
    assert not (where / "cache").exists()
