"""``python -m fused_ce_patch {demo,doctor}`` and the demo's building blocks.

Fast tests cover argument handling, the data reader and packer, the memory probe, the table
and the loss-agreement rule. The ``slow`` ones run the real commands: the doctor, and the demo
end to end on real SmolLM2 with small settings and a user's ``--data`` file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fused_ce_patch import cli
from fused_ce_patch.demo import compare, data, memory


def run_cli(*args: str, timeout: float = 1800, env: dict | None = None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("FUSED_CE_", "TRITON_"))}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "fused_ce_patch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
    )


# -- arguments --------------------------------------------------------------------------------


def test_help_lists_every_option():
    proc = run_cli("demo", "--help")
    assert proc.returncode == 0
    for option in ("--model", "--seq-len", "--batch-size", "--steps", "--backend", "--data"):
        assert option in proc.stdout


def test_no_command_is_a_usage_error():
    proc = run_cli()
    assert proc.returncode == 2
    assert "demo" in proc.stderr and "doctor" in proc.stderr


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--seq-len", "-3"], ["--batch-size", "x"]])
def test_bad_numbers_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *bad])
    assert exit_info.value.code == 2


def test_unknown_backend_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--backend", "cuda-magic"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cuda-magic" in err and "torch" in err


def test_backend_that_cannot_run_on_cpu_is_one_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(compare, "run_demo", lambda options: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--backend", "triton"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --backend" in err and "triton" in err and "Traceback" not in err
    assert err.count("error:") == 1


def test_non_number_says_what_was_expected(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--seq-len", "abc"])
    err = capsys.readouterr().err
    assert "--seq-len: expected a positive integer, got 'abc'" in err
    assert "_positive" not in err


def test_version(capsys):
    from fused_ce_patch import __version__

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv0", "prog"),
    [
        ("/venv/bin/fused-ce-patch", "fused-ce-patch"),
        ("/repo/fused_ce_patch/__main__.py", "python -m fused_ce_patch"),
        ("", "python -m fused_ce_patch"),
    ],
)
def test_program_name_follows_how_it_was_started(argv0, prog):
    assert cli.program_name(argv0) == prog


def test_model_path_unknown_name_is_an_error(capsys):
    assert cli.main(["model-path", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "smollm2" in err


def test_short_text_is_repeated_and_the_caller_is_told():
    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    told = []
    blocks = data.pack_blocks(Tok(), ["abc"], 4, 3, on_repeat=lambda *a: told.append(a))
    assert blocks.shape == (3, 4) and told == [(4, 12)]
    told.clear()
    data.pack_blocks(Tok(), ["abcdefghijklmnop"], 4, 3, on_repeat=lambda *a: told.append(a))
    assert told == []


def test_unknown_model_is_refused(capsys, tmp_path):
    assert cli.main(["demo", "--model", str(tmp_path / "nowhere")]) == 2
    assert "smollm2" in capsys.readouterr().err


def test_missing_data_is_refused(capsys, tmp_path):
    assert cli.main(["demo", "--data", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- data -------------------------------------------------------------------------------------


def test_default_text_is_real_english():
    texts = data.read_texts()
    assert len(texts) >= 5
    assert sum(map(len, texts)) > 100_000
    assert any("GNU GENERAL PUBLIC LICENSE" in t for t in texts)


def test_reads_txt_jsonl_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n"
    )
    assert data.read_texts(tmp_path / "a.txt") == ["first document\n"]
    assert data.read_texts(tmp_path / "b.jsonl") == ["one", "two"]
    sub = tmp_path / "dir"
    sub.mkdir()
    (sub / "x").write_text("x text")
    (sub / "y").symlink_to(sub / "x")  # the same file twice counts once
    assert data.read_texts(sub) == ["x text"]


@pytest.mark.parametrize(
    "name, content",
    [("bad.jsonl", '{"content": "no text field"}\n'), ("bad.csv", "a,b\n"), ("empty.txt", "  \n")],
)
def test_unusable_data_raises_data_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(data.DataError):
        data.read_texts(path)


class CharTokenizer:
    """Stands in for a transformers tokenizer: one id per character, eos = 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_pack_blocks_joins_documents_and_repeats_short_text():
    blocks = data.pack_blocks(CharTokenizer(), ["ab", "cde"], seq_len=4, n_blocks=3)
    stream = [97, 98, 0, 99, 100, 101, 0]
    assert blocks.shape == (3, 4) and blocks.dtype == torch.long
    assert blocks.flatten().tolist() == (stream * 2)[:12]


# -- memory probe -----------------------------------------------------------------------------


def test_peak_rss_sees_a_transient_allocation():
    """In a fresh process (pytest's own may hold freed memory that a new tensor would reuse
    without growing the resident set), a freed 64 MiB tensor still shows in the peak."""
    probe = (
        "import torch; from fused_ce_patch.demo import memory\n"
        "assert memory.reset_peak()\n"
        "before = memory.peak_rss()\n"
        "block = torch.ones(64 * 2**20 // 4)\n"
        "del block\n"
        "print(memory.peak_rss() - before, memory.peak_rss() - memory.current_rss())\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    grew, above_now = map(int, proc.stdout.split())
    assert grew >= 60 * 2**20
    assert above_now >= 60 * 2**20  # freed again, yet the peak remembers it


# -- the comparison ---------------------------------------------------------------------------


def fake_result(fused_losses, stock_losses):
    def run(losses, fused):
        return {
            "fused": fused, "backend": "torch" if fused else None, "losses": losses,
            "step_times_s": [1.0] * len(losses), "tokens_per_s": 100.0 if fused else 90.0,
            "cpu_s_per_step": 2.0 if fused else 2.5,
            "tokens_per_step": 512, "rss_before_bytes": 1 << 30,
            "peak_rss_bytes": (2 << 30) if fused else (3 << 30),
            "logits_types": ["NotMaterializedLogits"] if fused else ["Tensor"],
            "load_average": [1.0, 1.5],
        }

    return {
        "setup": {"title": "Tiny", "model_type": "llama", "vocab_size": 1000, "steps": 2,
                  "batch_size": 2, "seq_len": 256, "tokens_per_step": 512},
        "machine": {"date": "2026-11-30", "cpu": "CPU", "cores": 2, "memory_gib": 24,
                    "torch": "2", "transformers": "5"},
        "fused": run(fused_losses, True),
        "stock": run(stock_losses, False),
    }


def test_losses_match_rule():
    assert compare.losses_match([2.0, 1.5], [2.0 * (1 + 1e-5), 1.5 * (1 + 5e-5)])[0]
    assert not compare.losses_match([2.0, 1.5], [2.0 * (1 + 5e-5), 1.5])[0]
    assert not compare.losses_match([2.0, 1.5], [2.0, 1.5 * (1 + 5e-4)])[0]
    assert not compare.losses_match([2.0], [2.0, 1.0])[0]


def test_table_has_every_step_and_the_memory_rows():
    table = compare.format_table(fake_result([2.5, 2.25], [2.5, 2.25]))
    assert "| 1 | 2.500000 | 2.500000 | 0.0e+00 |" in table
    assert "| 2 | 2.250000 | 2.250000 |" in table
    assert "| peak RSS while training (MiB) | 2,048 | 3,072 | 0.67 |" in table
    assert "| growth over RSS at start of training (MiB) | 1,024 | 2,048 | 0.50 |" in table
    assert "| CPU time per step, median (s) | 2.0 | 2.5 | 0.80 |" in table
    # wall-clock speed follows the machine's load, not the patch: shown without a ratio
    assert "| tokens/s, median step (wall clock: follows machine load) | 100.0 | 90.0 " \
           "| not compared |" in table
    assert "1.11" not in table
    assert "none (sentinel) | real tensor" in table
    assert "512 tokens x 1000 x 4 B" in table


# -- the real commands ------------------------------------------------------------------------


@pytest.mark.slow
def test_doctor_reports_versions_devices_and_checks():
    proc = run_cli("doctor", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for name in ("torch", "triton", "transformers", "accelerate", "peft"):
        assert f"  {name} " in out
    assert "cpu: auto -> torch" in out
    assert "PASS  cpu    torch      float32" in out
    assert "FAIL" not in out


@pytest.mark.slow
def test_doctor_checks_triton_kernels_in_the_interpreter():
    """Under TRITON_INTERPRET=1 the Triton (and Ascend) kernels run on CPU tensors; the doctor
    finds them runnable and their numbers pass, while ``auto`` keeps the CPU's own backend
    (torch): the interpreter is for explicit requests only."""
    proc = run_cli("doctor", timeout=900, env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpu: auto -> torch" in proc.stdout
    assert "PASS  cpu    triton     float32" in proc.stdout
    assert "FAIL" not in proc.stdout


@pytest.mark.slow
def test_demo_end_to_end_on_smollm2_with_user_data(tmp_path):
    """The main job with small settings on real SmolLM2 and a ``.jsonl`` file of real text."""
    texts = data.read_texts()[:3]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    report = tmp_path / "demo.json"
    proc = run_cli(
        "demo", "--model", "smollm2", "--seq-len", "64", "--batch-size", "2", "--steps", "2",
        "--data", str(corpus), "--json", str(report),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| step | loss, fused | loss, stock | rel. diff |" in proc.stdout
    assert "Loss curves agree" in proc.stdout
    result = json.loads(report.read_text())
    assert result["losses_match"]
    assert result["setup"]["data"] == str(corpus)
    assert len(result["fused"]["losses"]) == len(result["stock"]["losses"]) == 2
    assert result["fused"]["backend"] == "torch"
    assert result["fused"]["logits_types"] != ["Tensor"]
    assert result["stock"]["logits_types"] == ["Tensor"]
    # Trainer's own progress bar and per-step log lines reach the user.
    assert "'loss':" in proc.stdout + proc.stderr


def test_both_runs_get_passive_openmp_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env, note = compare.child_environment()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "PASSIVE" in note
    assert "OMP_WAIT_POLICY" not in os.environ  # only the children's environment
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice wins
    env, note = compare.child_environment()
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and note is None


def test_model_path_prints_only_the_path_on_stdout(monkeypatch, capfd, tmp_path):
    """Whatever is printed while the path is resolved (the first use's notices, a library's
    notice through ``print``, C code or a child process writing to file descriptor 1) goes to
    stderr: ``$(fused-ce-patch model-path smollm2)`` is the path."""
    from fused_ce_patch.demo import models

    def noisy(name, *, quiet=False):
        print("[fused_ce_patch] dequantising ... (notice)")
        os.write(1, b"[WARNING] a library's notice on fd 1\n")
        subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
        return tmp_path / name

    monkeypatch.setattr(models, "local_model_path", noisy)
    assert cli.main(["model-path", "smollm2"]) == 0
    out, err = capfd.readouterr()
    assert out == f"{tmp_path / 'smollm2'}\n"
    for noise in ("(notice)", "fd 1", "a child process"):
        assert noise in err
    print("stdout works again")  # restored after the call
    assert capfd.readouterr().out == "stdout works again\n"


def test_first_conversion_notices_go_to_stderr(tmp_path, monkeypatch, capfd):
    """``cached_model_dir`` says what it is doing on a first use, on stderr (not stdout)."""
    from fused_ce_patch.demo import models

    monkeypatch.setenv("FUSED_CE_PATCH_CACHE", str(tmp_path))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    def fake_dequantise(src, out_dir, *, quiet=False):
        (out_dir / "fused_ce_patch_source.json").write_text("{}")

    monkeypatch.setattr(models, "dequantise_gguf", fake_dequantise)
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: object())
    path = models.cached_model_dir(gguf)
    out, err = capfd.readouterr()
    assert out == "" and "dequantising tiny.gguf" in err and "cached in" in err
    assert models._entry_complete(path)


@pytest.mark.slow
def test_model_path_prints_the_local_directory_of_the_real_weights():
    from fused_ce_patch.demo import local_model_path

    proc = run_cli("model-path", "smollm2", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1, proc.stdout  # the path alone, even with deepspeed
    path = proc.stdout.strip()
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    assert str(local_model_path("smollm2")) == path


@pytest.mark.slow
def test_quiet_conversion_shows_no_progress_bars(tmp_path, monkeypatch, capfd):
    """``local_model_path(quiet=True)`` prints nothing: the first conversion's progress bars
    (transformers', the GGUF reader's tqdm) are hidden."""
    from fused_ce_patch.demo import models

    monkeypatch.setenv("FUSED_CE_PATCH_CACHE", str(tmp_path))
    path = models.local_model_path("smollm2", quiet=True)
    assert str(path).startswith(str(tmp_path)) and (path / "config.json").is_file()
    err = capfd.readouterr().err
    assert "it/s" not in err and "%|" not in err, err[-500:]
