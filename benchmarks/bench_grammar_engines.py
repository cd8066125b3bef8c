"""llguidance (the engine Steadfast uses) against xgrammar on this machine, on the model's own vocabulary:
the time to compile a grammar from a JSON schema, and the time to compute one token mask and advance, along a
valid output of each schema (its tokens as the model's tokenizer writes them), one thread each.

xgrammar is not a dependency (it needs torch, transformers and triton at import: the router never imports
torch): put it beside Steadfast's venv (which has torch and transformers; triton is not needed on the CPU):

    .venv/bin/pip install --no-deps --target /tmp/xgpkgs xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xgpkgs .venv/bin/python benchmarks/bench_grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance

from steadfast.config.platform import default_model_path
from steadfast.model import grammar
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.ops.harness.soak import SCHEMA

ROOT = Path(__file__).resolve().parent.parent
# (name, schema, a valid instance: written compact, as both engines are told to write JSON)
READINGS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 24}
CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("facts (the soak's)", SCHEMA, {"topic": "the sea", "facts": ["it is salty", "it covers much"], "year": 2024}),
    (
        "readings (integers, bounds)",
        {"type": "object", "properties": {"city": {"type": "string"}, "readings": READINGS}, "required": ["readings"]},
        {"city": "Oslo", "readings": list(range(3, 75, 3))},
    ),
    (
        "nested with enum and pattern",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "owner": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "role": {"enum": ["admin", "user", "guest"]}},
                    "required": ["name", "role"],
                },
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["id", "owner", "tags"],
        },
        {"id": "ABC-1234", "owner": {"name": "Ada", "role": "admin"}, "tags": ["a", "b"]},
    ),
]


def llg_run(vocab: llguidance.LLTokenizer, schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    text = grammar.from_json_schema(schema)
    matcher = llguidance.LLMatcher(vocab, text, limits=grammar.limits())
    compiled = time.perf_counter() - t0
    steps = []
    for t in ids:
        s = time.perf_counter()
        matcher.compute_bitmask()
        ok = matcher.consume_token(t)
        steps.append(time.perf_counter() - s)
        assert ok, matcher.get_error()
    return compiled, steps


def xgr_run(xgr: Any, info: Any, schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled_grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(compiled_grammar)
    compiled = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for t in ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        ok = matcher.accept_token(t)
        steps.append(time.perf_counter() - s)
        assert ok, t
    return compiled, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5, help="runs of each case per engine (the median is kept)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grammar_engines.json"))
    args = p.parse_args()
    tok = GGUFTokenizer.from_gguf(default_model_path())
    t0 = time.perf_counter()
    vocab = grammar.ll_tokenizer(tok)
    llg_vocab_s = time.perf_counter() - t0
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    info, xgr_vocab_s = None, None
    if xgr is not None:
        t0 = time.perf_counter()
        raw = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(
            raw, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=list(tok.info.eos_token_ids)
        )
        xgr_vocab_s = time.perf_counter() - t0
    results: dict[str, Any] = {"vocabulary_s": {"llguidance": llg_vocab_s, "xgrammar": xgr_vocab_s}, "cases": []}
    for name, schema, instance in CASES:
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special=False)
        ids.append(tok.info.eos_token_ids[0])
        row: dict[str, Any] = {"case": name, "tokens": len(ids)}
        engines = [("llguidance", lambda s=schema, i=ids: llg_run(vocab, s, i))]
        if xgr is not None:
            engines.append(("xgrammar", lambda s=schema, i=ids: xgr_run(xgr, info, s, i)))
        for engine, run in engines:
            compiles, masks = [], []
            for _ in range(args.repeat):
                compiled, steps = run()
                compiles.append(compiled)
                masks.append(statistics.mean(steps))
            row[engine] = {"compile_ms": 1000 * statistics.median(compiles), "mask_us": 1e6 * statistics.median(masks)}
        results["cases"].append(row)
        print(json.dumps(row))
    Path(args.out).write_text(json.dumps(results, indent=2))
    print("vocabulary:", json.dumps(results["vocabulary_s"]))


if __name__ == "__main__":
    main()
