"""Write a copy of a llama GGUF that keeps only its first N layers.

Real tokenizer, embeddings and weights, the same code paths, a fraction of the compute: the fault and
protocol tests that compare a server with the in-process engine (not with `transformers`) run on it
(the `small_model` fixture), and so do the GPU checks (the GPU machine takes at most 64 MiB of files
per run; the default model is 94 MiB).

    python tests/small_gguf.py OUT.gguf --layers 4 [--model PATH]
"""

from __future__ import annotations

import argparse
import re

import gguf
import numpy as np

from steadfast.config import default_model_path


def truncate(src: str, dst: str, layers: int) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds its own header fields and the architecture
        kind = field.types[0]
        if name == f"{arch}.block_count":
            writer.add_uint32(name, layers)
        elif kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    for tensor in reader.tensors:
        match = re.match(r"blk\.(\d+)\.", tensor.name)
        if match and int(match.group(1)) >= layers:
            continue
        # Quantized tensors keep their raw bytes and type (the writer reads their shape in bytes).
        data = np.asarray(tensor.data)
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    truncate(args.model or default_model_path(), args.out, args.layers)


if __name__ == "__main__":
    main()
