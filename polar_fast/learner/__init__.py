"""What the GRPO learner (polar_fast/grpo.py) uses:

    batches.py           the step batch, the layouts, packing a group's calls; token rows for SFT
    losses.py            advantages, the PPO token loss, KL, aggregation weights (pure tensors)
    packed_forward.py    logprobs of packed micro-batches, chunked so logits never materialise whole
    packed_attention.py  attention over a packed batch (tree rule or per-sequence causal), per block
    checkpoint.py        save / resume of model, optimizer, step and policy version
    weight_sync.py       pushing new weights to the engine (in-process, disk reload, vLLM transfer)
    distributed.py       torchrun + FSDP2: rank 0 leads, the other ranks follow each learner call
    sft.py               supervised fine-tuning on exported token rows (the caller passes the learner)
    sft_process.py       the same in a child process, so what the fine-tune held leaves with it
    host_memory.py       a CPU learner's freed activations returned to the OS (glibc's mmap threshold)

Nothing here imports grpo.py: the layers only point down (tests/test_layout.py).
"""
