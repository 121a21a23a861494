"""What a run shows and leaves behind for people: metrics.py (metrics.jsonl and TensorBoard) and
progress.py (the live progress display and the summary table at the end)."""
