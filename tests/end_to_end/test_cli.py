"""`graphpass inspect`: one-line errors with exit code 2, the printed report, --json, --dump."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from graphpass.cli import main, parse_input

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
PPO = os.path.join(ROOT, "examples", "ppo_loss.py")
SMALL = ["--input", "logits=64x128:bfloat16", "--input", "tokens=64:int64", "--input", "old_logp=64",
         "--input", "advantages=64", "--input", "mask=64", "--arg", "temperature=0.7"]


@pytest.fixture(autouse=True)
def _reset():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["inspect", "nowhere/missing.py:f"], "no such file: nowhere/missing.py"),
    (["inspect", PPO + ":not_there"], "has no function 'not_there'"),
    (["inspect", PPO], "malformed target"),
    (["inspect", PPO + ":ppo_loss", "--input", "logits=64xabc:float32"], "malformed shape '64xabc'"),
    (["inspect", PPO + ":ppo_loss", "--input", "logits=64x128:float33"], "unknown dtype 'float33'"),
    (["inspect", PPO + ":ppo_loss", "--input", "logits64x128"], "malformed --input"),
    (["inspect", PPO + ":ppo_loss", "--input", "logits=64x128"], "missing --input or --arg for parameter 'tokens'"),
    (["inspect", PPO + ":ppo_loss", *SMALL, "--input", "bogus=3"], "has no parameter 'bogus'"),
    (["inspect", PPO + ":ppo_loss", *SMALL, "--arg", "temperature=0.5"], "argument given twice: temperature"),
    (["inspect", PPO + ":ppo_loss", "--chunk-size", "0", *SMALL], "chunk_size must be a positive int"),
])
def test_bad_spec_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_option_is_exit_2(capsys):
    code, _, err = run(capsys, "inspect", PPO + ":ppo_loss", "--bogus")
    assert code == 2 and "unrecognized arguments" in err


def test_import_error_in_user_file(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import not_a_module_anywhere\n")
    code, _, err = run(capsys, "inspect", f"{bad}:f")
    assert code == 2 and "cannot import" in err and "ModuleNotFoundError" in err


def test_parse_input_forms():
    assert parse_input("x=3x4:bf16") == ("x", (3, 4), torch.bfloat16, None)
    assert parse_input("t=5:int64") == ("t", (5,), torch.int64, None)
    assert parse_input("s=scalar") == ("s", (), torch.float32, None)
    assert parse_input("m=5:float32:nograd")[3] is False


def test_inspect_prints_graph_candidates_and_table(capsys):
    code, out, err = run(capsys, "inspect", PPO + ":ppo_loss", *SMALL)
    assert code == 0, err
    assert "== graph 0: captured (ATen, before rewrite) ==" in out
    assert "log_softmax" in out
    assert "== graph 0: candidates ==" in out
    assert "ppo_loss.py:" in out  # the candidate's (or site's) source line
    assert "as written" in out and "x floor" in out
    report = out[out.index("== graph 0: candidates =="):]  # the graphs' code aside, every line fits
    assert max(map(len, report.splitlines())) <= 100
    assert "logits=64x128:bfloat16 (grad)" in out


def test_inspect_json_is_json_only(capsys):
    code, out, err = run(capsys, "inspect", PPO + ":ppo_loss", *SMALL, "--json")
    assert code == 0, err
    data = json.loads(out)
    (g,) = data["graphs"]
    assert g["peak_before"] > 0 and g["floor_bytes"] >= 64 * 128 * 2  # logits.grad (+ the [T] float inputs')
    assert len(g["sites"]) == 1  # the core rewrites the log-prob + entropy region
    for s in g["sites"]:
        assert s["source"].startswith("ppo_loss.py:")
        assert "logprob" in s["kind"] and s["entropy_grad"] == "dropped"  # ent_coef defaults to 0.0
    assert g["peak_after"] < g["peak_before"]
    assert data["inputs"]["temperature"] == "0.7"


def test_inspect_a_cuda_configuration_without_a_gpu(capsys):
    code, out, err = run(capsys, "inspect", PPO + ":ppo_loss", *SMALL, "--json", "--device", "cuda")
    assert code == 0, err
    (g,) = json.loads(out)["graphs"]
    assert len(g["sites"]) == 1 and g["peak_after"] < g["peak_before"]
    if not torch.cuda.is_available():  # a CUDA build without a GPU too (torch 2.11's wheel here failed)
        assert "traced on meta tensors" in err


def test_nothing_to_rewrite_has_zero_sites(tmp_path, capsys):
    f = tmp_path / "mse.py"
    f.write_text(textwrap.dedent("""
        def mse(pred, target):
            print("user output goes to stderr under --json")
            return ((pred - target) ** 2).mean()
    """))
    code, out, err = run(capsys, "inspect", f"{f}:mse", "--input", "pred=64x128", "--input", "target=64x128:nograd",
                         "--json")
    assert code == 0, err
    (g,) = json.loads(out)["graphs"]
    assert g["sites"] == [] and g["candidates"] == [] and g["bytes_saved"] == 0
    assert "user output goes to stderr" in err


def test_dump_writes_importable_graphs(tmp_path, capsys):
    code, _, err = run(capsys, "inspect", PPO + ":ppo_loss", *SMALL, "--no-graphs", "--dump", str(tmp_path))
    assert code == 0, err
    files = sorted(os.listdir(tmp_path))
    assert "graph0.captured.capture.py" in files
    for name in files:
        graph, stage, pass_name, ext = name.split(".")
        assert graph == "graph0" and ext == "py"
        spec = importlib.util.spec_from_file_location(f"dump_{stage}_{pass_name}", tmp_path / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert isinstance(module.GraphModule, type)


def test_production_shapes_allocate_nothing():
    """T=32768, V=151936, bf16 (one [T, V] fp32 copy is 19.9 GB) in well under a minute and 4 GiB."""
    cmd = [sys.executable, "-m", "graphpass", "inspect", PPO + ":ppo_loss", "--input", "logits=32768x151936:bfloat16",
           "--input", "tokens=32768:int64", "--input", "old_logp=32768", "--input", "advantages=32768",
           "--input", "mask=32768", "--arg", "temperature=0.7", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["graphs"][0]["peak_before"] > 19_000_000_000  # eager would need > 4 fp32 copies
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert peak_rss < 4 * 2**30


def test_inputs_the_function_cannot_take_are_one_line_with_the_cause_and_exit_2(capfd):
    # 1-D logits: torch's gather refuses them while Dynamo traces. The cause is torch's own message
    # and the user's line, not Dynamo's wrapper, and torch's logged traceback stays out of stderr.
    argv = ["inspect", PPO + ":ppo_loss", "--input", "logits=64", "--input", "tokens=64:int64",
            "--input", "old_logp=64", "--input", "advantages=64", "--input", "mask=64"]
    code = main(argv)
    out, err = capfd.readouterr()
    assert code == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Index tensor must have the same number of dimensions as input tensor" in lines[0]
    assert "ppo_loss.py:26" in lines[0] and "gather" in lines[0]
    assert "TorchRuntimeError" not in lines[0]


def test_an_error_raised_by_the_user_code_is_its_cause(tmp_path, capfd):
    user = tmp_path / "checks.py"
    user.write_text(textwrap.dedent("""
        import torch

        def loss(logits):
            if logits.shape[-1] < 100:
                raise ValueError("the vocabulary is too small")
            return logits.log_softmax(-1).sum()
    """))
    code = main(["inspect", f"{user}:loss", "--input", "logits=4x8"])
    out, err = capfd.readouterr()
    assert code == 2, err
    assert err.strip().splitlines() == [err.strip()]
    assert "ValueError: the vocabulary is too small" in err
