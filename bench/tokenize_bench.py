"""Tokenize bench: polar_fast's Rust BpeEncoder vs HF `tokenizers` on SmolLM2-135M-Instruct.

Two kinds of text, each a set of distinct texts made with a seeded RNG: ~1.2 KB `ls -l`-like tool
outputs, and ~20 KB mixed texts (chat turns, code, prose, unicode). HF is timed as the proxy
calls it (`encode_batch_fast([text], add_special_tokens=False)`, one text per call); the Rust
encoder one text per `encode_many` call, twice over the same set: "cold" starts from a fresh
encoder (empty word cache), "warm" is the second pass. Ids are compared with HF's (ids_equal in the RESULT line); timings are
printed, never asserted. The speedup in the RESULT line uses the cold pass.

    python bench/tokenize_bench.py [--quick]
Last line: RESULT bpe_speedup=X ids_equal=1 tokens=N (ids_equal: every text's ids, cold and warm, equal
HF's; tokens: HF's id count over all texts, a deterministic check for tests)
"""

from __future__ import annotations

import argparse
import random
import time

from polar_fast.capture.tokenizer import fast_encoder
from polar_fast.model import load_tokenizer

WORDS = ["the", "file", "error", "def", "return", "import", "self", "None", "value", "path", "config",
         "naïve", "café", "日本語", "данные", "😀", "42", "3.14", "I'm", "don't", "README.md", "src"]


def ls_output(rng: random.Random, n_bytes: int = 1200) -> str:
    lines = ["total 48"]
    while sum(map(len, lines)) < n_bytes:
        kind = rng.choice(["drwxr-xr-x", "-rw-r--r--", "-rwxr-xr-x"])
        name = rng.choice(WORDS[:12]) + rng.choice(["", ".py", ".txt", ".json", "_test.py", "/"])
        lines.append(f"{kind} {rng.randint(1, 9):>2} root root {rng.randint(0, 99999):>6} "
                     f"{rng.choice(['Jan', 'Feb', 'Mar'])} {rng.randint(1, 28):>2} {rng.randint(0, 23):02}:"
                     f"{rng.randint(0, 59):02} {name}")
    return "\n".join(lines) + "\n"


def mixed_text(rng: random.Random, n_bytes: int = 20_000) -> str:
    parts: list[str] = []
    while sum(map(len, parts)) < n_bytes:
        kind = rng.randrange(4)
        if kind == 0:
            body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            parts.append(f"<|im_start|>{rng.choice(['user', 'assistant'])}\n{body}<|im_end|>\n")
        elif kind == 1:
            parts.append("".join(f"{'    ' * rng.randint(0, 3)}{rng.choice(WORDS)} = "
                                 f"{rng.choice(WORDS)}({rng.randint(0, 999)})\n" for _ in range(10)))
        elif kind == 2:
            parts.append(ls_output(rng, 400))
        else:
            parts.append(" ".join(rng.choice(WORDS) for _ in range(40)) + ".\n\n")
    return "".join(parts)


def timed(fn, texts: list[str]) -> tuple[float, list[list[int]]]:
    out = []
    t0 = time.perf_counter()
    for text in texts:
        out.append(fn(text))
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="few texts; finishes in seconds")
    args = parser.parse_args()
    tok = load_tokenizer("")
    hf = tok._tokenizer
    n = (20, 3) if args.quick else (400, 40)
    rng = random.Random(0)
    cases = {"tool output 1.2 KB": [ls_output(rng) for _ in range(n[0])],
             "mixed 20 KB": [mixed_text(rng) for _ in range(n[1])]}
    print(f"{'text':<20} {'tokens':>8} {'HF ns/tok':>10} {'cold ns/tok':>12} {'warm ns/tok':>12} {'speedup':>8}")
    speedups, total_tokens, equal = [], 0, True
    for name, texts in cases.items():
        enc = fast_encoder(tok)
        assert enc is not None
        hf_s, want = timed(lambda t: hf.encode_batch_fast([t], add_special_tokens=False)[0].ids, texts)
        cold_s, got = timed(lambda t: enc.encode_many([t])[0], texts)
        warm_s, again = timed(lambda t: enc.encode_many([t])[0], texts)
        equal = equal and got == want and again == want
        if got != want or again != want:
            print(f"{name}: ids differ from HF")
        n_tok = sum(map(len, want))
        total_tokens += n_tok
        speedups.append(hf_s / cold_s)
        print(f"{name:<20} {n_tok:>8} {hf_s / n_tok * 1e9:>10.0f} {cold_s / n_tok * 1e9:>12.0f} "
              f"{warm_s / n_tok * 1e9:>12.0f} {hf_s / cold_s:>7.1f}x")
    print(f"\nRESULT bpe_speedup={min(speedups):.1f} ids_equal={int(equal)} tokens={total_tokens}")


if __name__ == "__main__":
    main()
