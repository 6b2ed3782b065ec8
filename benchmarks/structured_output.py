"""Structured output: xgrammar vs llguidance on this machine, for the bundled model's tokenizer
(SmolLM2, 49,152 tokens), side by side in one run. Which one pdserve uses is decided here.

For each library and each constraint (a small JSON schema, a nested one with arrays and enums,
any JSON object, a regex): the time to prepare the tokenizer once, to compile the constraint
(a fresh compiler, no cache), and per output token to fill the token mask and advance the
matcher, teacher-forced along a valid output (the same token ids for both). Medians over
`--repeats`. Also whether each library accepts the whole valid output.

    .venv/bin/python benchmarks/structured_output.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
            },
            "minItems": 1,
        },
        "note": {"type": "string"},
    },
    "required": ["id", "status", "items"],
}
CASES: dict[str, tuple[str, Any, str]] = {
    "json_schema_small": ("schema", PERSON, '{"name": "Ada Lovelace", "age": 36}'),
    "json_schema_nested": (
        "schema",
        ORDER,
        '{"id": "ABC-1234", "status": "shipped", "items": [{"sku": "x-1", "qty": 2, '
        '"price": 9.5}, {"sku": "y-22", "qty": 1, "price": 120}], "note": "leave at door"}',
    ),
    "json_object": ("schema", {"type": "object"}, '{"a": [1, 2, {"b": null}], "c": "d"}'),
    "regex": ("regex", r"[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,4})?", "555-0199 ext. 42"),
}


def xgrammar_run(hf: Any, vocab: int, kind: str, spec: Any, ids: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    prepare = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    if kind == "schema":
        compiled = compiler.compile_json_schema(json.dumps(spec))
    else:
        compiled = compiler.compile_regex(spec)
    compile_s = time.perf_counter() - t
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    per_token, accepted = [], True
    for token in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        ok = matcher.accept_token(token)
        per_token.append(time.perf_counter() - t)
        accepted &= bool(ok)
    return {"prepare_s": prepare, "compile_s": compile_s, "per_token": per_token, "ok": accepted}


def llguidance_run(hf: Any, vocab: int, kind: str, spec: Any, ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    prepare = time.perf_counter() - t
    t = time.perf_counter()
    if kind == "schema":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec))
    else:
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    matcher = llguidance.LLMatcher(tok, grammar)
    bitmask = lt.allocate_token_bitmask(1, vocab)
    lt.fill_next_token_bitmask(matcher, bitmask, 0)  # the lazy part of compiling
    compile_s = time.perf_counter() - t
    per_token, accepted = [], not matcher.is_error()
    for i, token in enumerate(ids):
        t = time.perf_counter()
        if i:
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
        ok = matcher.consume_token(token)
        per_token.append(time.perf_counter() - t)
        accepted &= bool(ok) and not matcher.is_error()
    return {"prepare_s": prepare, "compile_s": compile_s, "per_token": per_token, "ok": accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "structured_output.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from pdserve.config import ModelConfig, default_cache_dir
    from pdserve.model.fetch import resolve_model

    model_dir = resolve_model("default", default_cache_dir(), "float32")
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    runners = {"xgrammar": xgrammar_run, "llguidance": llguidance_run}
    results: dict[str, Any] = {}
    for case, (kind, spec, valid) in CASES.items():
        ids = hf.encode(valid, add_special_tokens=False)
        results[case] = {"output_tokens": len(ids)}
        for name, run in runners.items():
            runs = [run(hf, vocab, kind, spec, ids) for _ in range(args.repeats)]
            results[case][name] = {
                "prepare_ms": 1e3 * statistics.median(r["prepare_s"] for r in runs),
                "compile_ms": 1e3 * statistics.median(r["compile_s"] for r in runs),
                "mask_and_advance_ms_per_token": 1e3
                * statistics.median(x for r in runs for x in r["per_token"]),
                "accepts_the_valid_output": all(r["ok"] for r in runs),
            }
        x, g = results[case]["xgrammar"], results[case]["llguidance"]
        results[case]["llguidance_over_xgrammar"] = {
            "compile": g["compile_ms"] / x["compile_ms"],
            "per_token": g["mask_and_advance_ms_per_token"] / x["mask_and_advance_ms_per_token"],
        }
        print(case, json.dumps(results[case]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"repeats": args.repeats, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
