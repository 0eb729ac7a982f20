"""``main.py --plan`` as a user runs it, no torchrun: every rank's actions and the memory
verdict for a 13B run on four GPUs, and a GPU plan on a machine without one (one error line,
or with the choice given, a verdict that says it was not checked); the README's example as it
prints it; the exit status says whether the run fits."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT, env_without_dist


@pytest.mark.slow
def test_plan_cli_prints_every_rank_and_the_verdict():
    cmd = [sys.executable, str(ROOT / "main.py"), "--config", "", "--plan", "--model", "llama-2-13b", "--nproc", "4",
           "--num_stages", "8", "--batch_size", "64", "--num_chunks", "16", "--seq_length", "512", "--device", "cuda",
           "--use_offload", "--activation_checkpointing", "--gpu_memory_gb", "24", "--host_memory_gb", "512"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_without_dist(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "stage -> rank: [0, 1, 2, 3, 0, 1, 2, 3]" in out
    assert "decoder layers per stage: [" in out and "(partition cost: predicted step " in out
    assert all(f"rank {r} actions:" in out for r in range(4))
    assert "GPU:" in out and "fits" in out


@pytest.mark.slow
def test_plan_for_a_gpu_on_a_machine_without_one():
    cmd = [sys.executable, str(ROOT / "main.py"), "--config", "", "--plan", "--device", "cuda", "--model",
           "llama-2-7b", "--nproc", "2", "--use_offload"]
    env = {**env_without_dist(), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: --plan --device cuda without a visible GPU needs gpu_memory_gb"), lines[0]
    # with the choice made, a plan whose GPU verdict says it was not checked
    proc = subprocess.run(cmd + ["--resident_stages", "0", "--host_memory_gb", "256"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not checked (no GPU visible; gpu_memory_gb sets the card's size)" in proc.stdout


def _readme_plan_example() -> tuple[list[str], list[str]]:
    """The README's --plan command (its arguments after main.py) and the output it shows."""
    import shlex

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Will it fit? (`--plan`)"):]
    blocks = section.split("```")
    command, shown = blocks[1].removeprefix("bash\n"), blocks[3].strip("\n")
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["python3", "main.py"], argv
    return argv[2:], shown.splitlines()


def test_readme_plan_example_is_what_the_code_prints(capsys):
    """Each line the README shows is a line of the plan ("..." stands for a part left out), and the
    plan describes the host it names (host_memory_gb), not this machine: it fits, exit 0."""
    import main

    argv, shown = _readme_plan_example()
    assert "--host_memory_gb" in argv
    code = main.main(argv)
    printed = capsys.readouterr().out.splitlines()
    assert code == 0, printed
    for line in shown:  # "..." stands for what the README leaves out
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")))
        assert any(pattern.fullmatch(p) for p in printed), (line, printed)
    assert "host: 67.48 GiB for all ranks of 256.00 GiB (host_memory_gb): fits" in printed


@pytest.mark.slow  # two plans with their advice: seconds each
def test_plan_exit_status_says_whether_it_fits(capsys):
    """1 when the host (or GPU) memory would not hold the run, for scripts; 0 when it would."""
    import main

    argv, _ = _readme_plan_example()
    at = argv.index("--host_memory_gb")
    assert main.main(argv[:at] + ["--host_memory_gb", "48"] + argv[at + 2:]) == main.PLAN_DOES_NOT_FIT == 1
    out = capsys.readouterr().out
    assert "of 48.00 GiB (host_memory_gb): DOES NOT FIT" in out and "would fit with:" in out
    at = argv.index("--gpu_memory_gb")
    assert main.main(argv[:at] + ["--gpu_memory_gb", "16", "--resident_stages", "0"] + argv[at + 2:]) == 1
    assert "GPU: " in capsys.readouterr().out


@pytest.mark.slow  # the 70B plan chooses its stages: seconds
def test_readme_lora_plan_is_what_the_code_prints(capsys, monkeypatch):
    """The README's LoRA plan for 70B shapes on two 24 GiB GPUs: run as shown (device auto, on a
    machine without a GPU, ``gpu_memory_gb`` plans for GPUs of that size), it prints the peaks and
    host figures the README quotes."""
    import shlex

    import main
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    section = (ROOT / "README.md").read_text().split("## LoRA")[1].split("\n## ")[0]
    command = re.search(r"`(python3 main\.py --plan [^`]+)`: (.+?)\.\n", section, re.S)
    argv = shlex.split(command.group(1))
    assert "--device" not in argv
    assert main.main(argv[2:]) == 0
    out = capsys.readouterr().out
    assert "(cuda, 16-bit compute)" in out.splitlines()[0], out.splitlines()[0]
    for figure in re.findall(r"\d+\.\d\d GiB", command.group(2)) + re.findall(r"(\d+\.\d\d) and", command.group(2)):
        assert figure.split()[0] + " GiB" in out, (figure, out)


def test_plan_says_which_machine_and_asks_another_machines_process_count(capsys, monkeypatch):
    """--plan for GPUs of gpu_memory_gb on a machine without one planned two processes (train.sh's
    CPU default) without a word: the process count of another machine is asked for, and the plan
    says which machine it plans for and where its host figure comes from."""
    import main
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["--config", "", "--plan", "--model", "tiny", "--gpu_memory_gb", "8", "--use_offload", "--resident_stages",
            "0"]
    assert main.main(base) == 2
    assert capsys.readouterr().err == ("error: --plan for GPUs of 8 GiB (gpu_memory_gb) on a machine without one plans "
                                       "another machine: give --nproc, the number of its GPUs (one process each), e.g. "
                                       "--nproc 2\n")
    assert main.main(base + ["--nproc", "3", "--num_stages", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("machine: another machine (this one has no GPU), 3 GPUs of 8 GiB (gpu_memory_gb), one process "
                        "each (nproc); the host memory this machine has available now (host_memory_gb gives the "
                        "other's)"), lines[:2]
    assert main.main(["--config", "", "--plan", "--model", "tiny", "--device", "cpu", "--num_stages", "2",
                      "--host_memory_gb", "64"]) == 0
    assert "machine: this machine's CPU, 2 processes; 64 GiB of host memory (host_memory_gb)" in capsys.readouterr().out


@pytest.mark.slow  # an 8B LoRA plan and its advice: seconds
def test_plan_advice_includes_its_own_choice_of_stages(capsys, monkeypatch):
    """8B LoRA with offload on one 8 GiB GPU at 4 stages does not fit, and no single lever of the
    list fits it, but the plan's own choice of stages (num_stages -1) does: the advice said "no
    single change". The longest-row line it prints is a run that --plan accepts as it says."""
    import main
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--config", "", "--plan", "--nproc", "1", "--gpu_memory_gb", "8", "--model", "llama-3-8b", "--lora_rank",
            "16", "--use_offload", "--seq_length", "512", "--batch_size", "8", "--num_chunks", "8",
            "--activation_checkpointing"]
    assert main.main(argv) == main.PLAN_DOES_NOT_FIT
    out = capsys.readouterr().out
    [advice] = [line for line in out.splitlines() if line.startswith("would fit with: ")]
    chosen = re.search(r"num_stages: -1 \(the plan picks (\d+)\) -> \d+\.\d\d GiB per GPU", advice)
    assert chosen, advice
    assert main.main(argv + ["--num_stages", chosen.group(1)]) == 0  # the advice holds
    capsys.readouterr()
    assert main.main(argv + ["--num_stages", "-1"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("longest row")]
    longest = re.fullmatch(r"longest row that fits 8\.00 GiB \(8 micro-batches of 1 row, the plan's estimate, in "
                           r"steps of 1024\): (\d+) tokens with num_stages (\d+), seq_chunks (\d+), tiled_mlp (\w+)",
                           row)
    assert longest, row
    tokens, stages, chunks, tiled = longest.groups()
    at = ["--seq_length", tokens, "--num_stages", stages, "--seq_chunks", chunks, "--tiled_mlp", tiled,
          "--allow_long_sequences"]
    assert main.main(argv + at) == 0, capsys.readouterr().out  # the row it names fits as named
    capsys.readouterr()
    longer = [str(int(tokens) + 1024) if a == tokens else a for a in at]
    assert main.main(argv + longer) == main.PLAN_DOES_NOT_FIT  # and is the longest, in steps of 1024


@pytest.mark.slow
def test_plan_through_train_sh_asks_for_nproc_for_another_machine(tmp_path):
    env = {**env_without_dist(), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "train.sh"), "--plan", "--gpu_memory_gb", "8", "--save_dir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines[0].startswith("error: --plan for GPUs of 8 GiB"), proc.stderr[-2000:]
    proc = subprocess.run(["bash", str(ROOT / "train.sh"), "--plan", "--gpu_memory_gb", "8", "--nproc", "2",
                           "--save_dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "machine: another machine (this one has no GPU), 2 GPUs of 8 GiB" in proc.stdout
