"""A UTF-8 byte-order mark at the start of a source file (#33 item 11) is no part of its first record."""

import json

from test_ingest_quarantine import BYTES, _good

from pipeline.ingest import ingest
from warehouse.sources import read_text_sources


def test_a_leading_bom_does_not_quarantine_the_first_record(tmp_path):
    body = "\n".join(json.dumps(r) for r in [_good("g1"), _good("g2")])
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    sources = read_text_sources([path], [".jsonl"])
    assert sources == [(str(path), body)]
    res = ingest("chat-jsonl", sources, round_=1, tokenizer=BYTES)
    assert res.quarantine.num_rows == 0
    assert sorted(res.trajectories.column("traj_id").to_pylist()) == ["g1", "g2"]
