"""The one-pass GGUF reader against the `gguf` package's own reader, and on files that are not GGUF."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from steadfast.model.gguf_file import GGUFFile
from steadfast.model.gguf_meta import ModelLoadError, open_gguf

pytestmark = pytest.mark.unit


def test_metadata_and_tensors_equal_the_gguf_packages_reader(model_path):
    ours, theirs = GGUFFile(model_path), gguf.GGUFReader(model_path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert len(fields["tokenizer.ggml.tokens"]) == 49152  # the arrays that make the package slow, read whole
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.shape == tuple(int(d) for d in b.shape) and a.tensor_type == b.tensor_type, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("cut", [0, 3, 24, 5000, -1000])
def test_a_cut_or_foreign_file_is_a_clear_load_error(tmp_path, model_path, cut):
    data = open(model_path, "rb").read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut] if cut else b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        open_gguf(str(bad))
