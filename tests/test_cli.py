"""The `palace` command as a person uses it: piped chat, info, and one-line errors."""

import subprocess
import sys
from pathlib import Path

PALACE = [str(Path(sys.executable).parent / "palace")]


def palace(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(PALACE + list(args), input=stdin, capture_output=True, text=True, timeout=300)


def test_piped_chat_streams_replies_and_answers_commands():
    done = palace("chat", "--max-new-tokens", "6", "--budget", "256",
                  stdin="Hello, my name is Dana Whitfield.\n/stats\n/memory\n/reset\n/stats\n/quit\nnever read\n")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("palace> ") and len(lines[0]) > len("palace> ")
    rows = [line.split() for line in lines if not line.startswith(" ")]
    stats = [dict(row[:2] for row in rows[k:k + 12] if len(row) == 2) for k, row in enumerate(rows) if row[:1] == ["kv_tokens"]]
    assert len(stats) == 2 and stats[0]["policy"] == "hybrid" and stats[0]["budget"] == "256" and stats[0]["turns"] == "1"
    assert stats[1]["turns"] == "0" and "(conversation reset)" in lines
    assert "fact  name: 'Dana Whitfield' (from turn 0, current)" in lines  # /memory shows the graph's facts
    assert any(line.strip() == "Name: Dana Whitfield" for line in lines)  # and the notes in the permanent tier
    assert "Traceback" not in done.stderr


def test_info_reports_gqa_geometry():
    done = palace("info")
    assert done.returncode == 0, done.stderr
    rows = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert rows["kv_heads"] == "3" and rows["query_heads"] == "9" and rows["layers"] == "30"
    assert int(rows["bytes_per_token_without_gqa"]) == 3 * int(rows["bytes_per_cached_token"])


def test_bad_input_is_one_line_and_nonzero():
    for args in (["chat", "--policy", "lru"], ["chat", "--budget", "lots"], ["chat", "--kv-dtype", "int3"],
                 ["info", "--model", "/no/such/model"], ["chat", "--weights", "int2"]):
        done = palace(*args, stdin="hi\n")
        assert done.returncode != 0, args
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)


def test_invalid_utf8_on_stdin_is_replaced_and_said_once():
    done = subprocess.run(PALACE + ["chat", "--max-new-tokens", "3", "--budget", "256"],
                          input=b"caf\xe9 \xff\xfe please\nand \xc3 again\n/quit\n", capture_output=True, timeout=300)
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "Traceback" not in err and err.count("not valid UTF-8") == 1
    assert done.stdout.decode().count("palace> ") == 2  # both messages answered
