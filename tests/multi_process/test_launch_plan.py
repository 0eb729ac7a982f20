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
