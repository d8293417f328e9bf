"""The command line: print-config output and error exit codes."""

import subprocess
import sys
from pathlib import Path

from moetrain.cli import main, parse_args
from moetrain.config import load_config
from moetrain.model_numbers import model_numbers
from tests.unit.test_data_prepare import write_jsonl

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny-cpu.yaml")


def test_print_config_shows_resolved_values_and_derived_numbers(capsys):
    assert main(["print-config", TINY, "moe.num_experts=16"]) == 0
    out = capsys.readouterr().out
    assert "num_experts: 16" in out
    n = model_numbers(load_config(TINY, ["moe.num_experts=16"]))
    assert f"total_params: {n.total_params}" in out
    assert f"active_params_per_token: {n.active_params}" in out
    assert "train_flops_per_token:" in out
    # which update every parameter takes: AdamW, all of them
    assert f"update_adamw: {n.total_params}  # " in out


def test_config_error_exits_2_with_the_key(capsys):
    assert main(["print-config", TINY, "moe.top_k=99"]) == 2
    assert "moe.top_k" in capsys.readouterr().err


def test_python_dash_m_is_the_same_program():
    out = subprocess.run(
        [sys.executable, "-m", "moetrain", "print-config", TINY],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "run_dir: runs/tiny-cpu" in out


def test_prepare_does_not_import_torch(tmp_path):
    """Every rank of a multi-node prepare pays the start-up: torch alone is ~2 s of imports."""
    docs = [f"document {i}: " + "some text to tokenize " * 20 for i in range(60)]
    source = write_jsonl(tmp_path / "c.jsonl", docs)
    probe = (
        "import sys; from moetrain.cli import main; "
        f"code = main(['prepare', {TINY!r}, 'data.source={source}', "
        f"'data.output_dir={tmp_path / 'out'}', 'model.vocab_size=320', 'data.num_proc=1']); "
        "assert code == 0, code; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_deepspeed_local_rank_argument_is_accepted(capsys):
    assert main(["print-config", TINY, "--local_rank=0"]) == 0


def test_plan_prints_memory_and_refuses_bad_layouts(capsys):
    assert main(["plan", TINY, "--gpus", "8", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "fits" in out
    assert main(["plan", TINY, "--gpus", "3"]) == 2
    assert "parallel.ep_size" in capsys.readouterr().err


def test_overrides_come_before_or_after_the_options(capsys):
    assert main(["plan", TINY, "--gpus", "8", "moe.top_k=1", "--gpu", "h200"]) == 0
    after = capsys.readouterr().out
    assert main(["plan", TINY, "moe.top_k=1", "--gpus", "8", "--gpu", "h200"]) == 0
    assert capsys.readouterr().out == after
    assert main(["plan", TINY, "--gpus", "8", "--gpu", "h200"]) == 0
    assert capsys.readouterr().out != after  # top_k=1 changed the active parameters
    args = parse_args(["train", TINY, "--reset-optimizer", "train.max_steps=3"])
    assert args.reset_optimizer and args.overrides == ["train.max_steps=3"]


def test_report_on_a_missing_run_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
