"""Writes the parquet fixtures from the hand-written JSON beside them, in the Arrow shapes the
sets are published in. Run it after editing a JSON source: `python tests/data/tasks/make_parquet.py`.

- swebench_verified.parquet: SWE-bench Verified's HF layout, every column a string (the test
  lists JSON-encoded), from swebench_verified.jsonl;
- swe_gym.parquet: SWE-Gym's, FAIL_TO_PASS / PASS_TO_PASS as list<string>, from swe_gym.json;
- skyrl_v0_293/{train,validation}.parquet: NovaSky-AI/SkyRL-v0-293-data's, columns prompt,
  data_source, ability and `instance` (a struct of the SWE-bench fields, lists as lists).
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent


def main() -> None:
    rows = [json.loads(line) for line in (HERE / "swebench_verified.jsonl").read_text().splitlines()]
    schema = pa.schema([(k, pa.string()) for k in rows[0]])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), HERE / "swebench_verified.parquet")
    pq.write_table(pa.Table.from_pylist(json.loads((HERE / "swe_gym.json").read_text())), HERE / "swe_gym.parquet")
    (HERE / "skyrl_v0_293").mkdir(exist_ok=True)
    for split, split_rows in json.loads((HERE / "skyrl_v0_293.json").read_text()).items():
        pq.write_table(pa.Table.from_pylist(split_rows), HERE / "skyrl_v0_293" / f"{split}.parquet")


if __name__ == "__main__":
    main()
