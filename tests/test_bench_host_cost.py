"""bench.host_cost runs and counts: the compiled graphs of a stack of small blocks hold no
more ATen ops than eager dispatches for the same forward and backward (the unpacking of a
gathered buffer is one split, flat gradients are packed as they are, autograd's transpose
and detach pairs are folded)."""

import json
import subprocess
import sys


def test_host_cost_counts_ops_and_times_every_system(tmp_path):
    code = ("import json, sys; from bench import host_cost; "
            "rows = host_cost.main(['--models', 'mlp48', '--steps', '1', '--reps', '1']); "
            "print('ROWS', json.dumps(rows))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads(out.stdout.split("ROWS", 1)[1])
    assert row["eager ops"] > 0 and row["graph ops"] > 0
    assert row["graph ops"] <= row["eager ops"], row  # 684 against 773 when written
    for system in ("eager", "autoshard", "fsdp2"):
        assert row[f"{system} ms"] > 0
