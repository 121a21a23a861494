"""What the capture proxy (polar_fast/proxy.py) uses, in the order a request meets it:

    dialects/    wire format <-> canonical conversation (pure; the Dialect Protocol), the incremental parse
    session.py   a rollout's session: its parsers, recorded calls, cause counts
    sampling.py  the run's sampling for one call (temperature, top_p, max_tokens, seed)
    history.py   exact history: a session's new prompt as token ids that extend the last ones
    render.py    chat template + tokenizer; parses sampled ids back into text, reasoning, tool calls
    template.py  the model's chat template (or a ChatML fallback), and skeleton.py, its markup learnt
    parsers.py   tool-call parsers (hermes JSON, qwen3_coder XML)
    tokenizer.py the Rust BPE encoder (the face of polar_fast._native's tokenizer)
    recorder.py  the bounded queue that writes every call to the run's record log
"""
