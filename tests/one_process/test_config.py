"""Configuration: precedence (defaults < YAML < flags), typing, unknown keys, and bad input
refused with the values in one line (through main.py and train.sh, one line from one rank with a
non-zero exit before any training: tests/multi_process/test_launch_config.py)."""
from __future__ import annotations

import pytest

from pipeline.config import RESUME_FREE, SECTIONS, ConfigError, launch_settings, load_yaml, make_config, parse_args


def _yaml(tmp_path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_precedence_defaults_yaml_flags(tmp_path):
    path = _yaml(tmp_path, "batch_size: 16\nnum_chunks: 8\nuse_offload: true\nlr: 0.001\n")
    cfg, used, mode = parse_args(["--config", path, "--num_chunks", "2", "--no_offload", "--no_prefetch"])
    assert used == path and mode == "train"
    assert parse_args(["--config", path, "--check_only"])[2] == "check"
    assert parse_args(["--config", path, "--dry_run"])[2] == parse_args(["--config", path, "--plan"])[2] == "plan"
    assert cfg.batch_size == 16          # YAML over default
    assert cfg.num_chunks == 2           # flag over YAML
    assert cfg.use_offload is False      # --no_offload over YAML's true
    assert cfg.use_prefetch is False
    assert cfg.lr == 0.001
    assert cfg.seq_length == make_config().seq_length  # untouched default


def test_yaml_sections_read_like_flat_keys(tmp_path):
    flat = _yaml(tmp_path, "model: tiny\nlr: 0.001\nuse_offload: true\nnproc: 2\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("model: {model: tiny}\noptimizer:\n  lr: 0.001\noffload: {use_offload: true}\n"
                      "launch: {nproc: 2}\n")
    assert load_yaml(str(nested)) == load_yaml(flat) == {"model": "tiny", "lr": 0.001, "use_offload": True, "nproc": 2}
    assert parse_args(["--config", str(nested), "--lr", "0.5"])[0] == make_config({"model": "tiny", "lr": 0.5,
                                                                                     "use_offload": True, "nproc": 2})
    with pytest.raises(ConfigError, match=r"key 'lr' is in section 'optimizer', not 'data'"):
        make_config({"data": {"lr": 0.1}})
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice"):
        make_config({"lr": 0.1, "optimizer": {"lr": 0.2}})
    with pytest.raises(ConfigError, match="unknown config key 'batchsize'"):
        make_config({"data": {"batchsize": 3}})


def test_auto_true_false_keys_take_yaml_booleans(tmp_path):
    """compile_layers is auto/true/false: YAML's true, false, on and off mean true and false, and
    anything else is one error line."""
    for text, want in (("true", "true"), ("off", "false"), ("auto", "auto")):
        assert parse_args(["--config", _yaml(tmp_path, f"compile_layers: {text}\n")])[0].compile_layers == want
    assert parse_args(["--config", "", "--compile_layers", "false"])[0].compile_layers == "false"
    with pytest.raises(ConfigError, match="compile_layers must be one of auto, true, false; got 'yes please'"):
        make_config({"compile_layers": "yes please"})


def test_sections_cover_every_key_once():
    names = [n for keys in SECTIONS.values() for n in keys]
    assert sorted(names) == sorted(make_config().to_dict()) and len(names) == len(set(names))
    assert {"nproc", "master_port", "cuda_visible_devices"} <= RESUME_FREE and "lr" not in RESUME_FREE


def test_legacy_flag_names_exist():
    cfg, _, _ = parse_args(["--config", "", "--batch_size", "4", "--num_chunks", "2", "--seq_length", "32",
                            "--embedding_dim", "64", "--ff_dim", "128", "--num_iterations", "3", "--num_stages", "2",
                            "--num_layers", "2", "--num_heads", "4", "--model", "tiny",
                            "--dataset", "sample", "--save_results", "r.json", "--save_params", "--save_dir", "d",
                            "--use_prefetch", "--use_offload"])
    assert (cfg.batch_size, cfg.use_offload, cfg.save_params, cfg.embedding_dim) == (4, True, True, 64)


def test_model_path_alias():
    cfg, _, _ = parse_args(["--config", "", "--model_path", "/some/dir"])
    assert cfg.model == "/some/dir"


def test_unknown_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'batchsize'"):
        make_config({"batchsize": 3})


def test_empty_yaml_is_refused(tmp_path):
    """An empty file would train with the built-in defaults, not the shipped fine_tune.yaml's."""
    for text in ("", "# only a comment\n"):
        with pytest.raises(ConfigError, match=r"is empty \(no key: value\); give its keys, or --config '' for"):
            parse_args(["--config", _yaml(tmp_path, text)])
    assert parse_args(["--config", ""])[1] is None  # no file at all: the defaults, as asked


@pytest.mark.parametrize("argv,message", [
    (["--nproc_per", "3"], "unrecognized arguments: --nproc_per 3 (did you mean --nproc?)"),
    (["--lr_sched", "cosine"], "(did you mean --lr_schedule, --schedule, --loss_scale?)"),  # the nearest first
    (["--num_stage", "4"], "(did you mean --num_stages, --num_layers, --resident_stages?); --help lists the flags"),
    (["--save", "x"], "unrecognized arguments: --save x"),  # a prefix is not a flag
    (["--lr"], "argument --lr: expected one argument"),
    (["--lr", "x"], "argument --lr: invalid float value: 'x'"),
])
def test_bad_flags_are_one_line(argv, message):
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", "", *argv])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_unknown_key_names_the_nearest_first():
    with pytest.raises(ConfigError, match=r"^unknown config key 'num_stage' \(did you mean num_stages, num_layers\?\)$"):
        make_config({"num_stage": 4})


def test_hints_name_no_entry_point():
    """The same line reaches people who ran train.sh and main.py: it names neither."""
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", "", "--bogus"])
    assert "main.py" not in str(info.value) and "--help lists the flags" in str(info.value)


@pytest.mark.parametrize("argv", [["--lr", "nan"], ["--lr", "inf"], ["--comm_timeout_s=-inf"],
                                  ["--gpu_memory_gb", "NaN"]])
def test_non_finite_numbers_are_refused(argv):
    """float() reads nan and inf: such a setting would start workers and train into save_dir."""
    with pytest.raises(ConfigError, match=rf"^config key '{argv[0][2:].split('=')[0]}' must be a finite number, got "):
        parse_args(["--config", "", *argv])


def test_non_finite_yaml_numbers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'adam_eps' must be a finite number, got nan"):
        parse_args(["--config", _yaml(tmp_path, "adam_eps: .nan\n")])


def test_yaml_exponents_without_a_dot_are_numbers(tmp_path):
    """PyYAML's safe loader (YAML 1.1) reads 3e-4 as a string; the config's loader reads it as a
    number, as YAML 1.2 and Python do, under a section too, and junk is still refused in one line."""
    cfg = parse_args(["--config", _yaml(tmp_path, "lr: 3e-4\noptimizer: {adam_eps: 1E-5}\n")])[0]
    assert cfg.lr == 3e-4 and cfg.adam_eps == 1e-5
    with pytest.raises(ConfigError, match=r"^config key 'lr' must be a number, got 'abc'$"):
        parse_args(["--config", _yaml(tmp_path, "lr: abc\n")])


@pytest.mark.parametrize("text,shown", [("1e3", "1000.0"), ("1.0e+3", "1000.0")])
def test_whole_numbers_written_as_floats_say_how_to_write_them(tmp_path, text, shown):
    with pytest.raises(ConfigError, match=rf"^config key 'num_iterations' must be an integer, got {shown} "
                                          r"\(write 1000\)$"):
        parse_args(["--config", _yaml(tmp_path, f"num_iterations: {text}\n")])
    with pytest.raises(ConfigError, match=r"^config key 'num_iterations' must be an integer, got 2.5$"):
        parse_args(["--config", _yaml(tmp_path, "num_iterations: 2.5\n")])


def test_help_groups_flags_by_section_with_the_yaml_values(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fine_tune.yaml").write_text("lr: 0.0003\nseed: 0\n")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    heads = [line for line in text.splitlines() if line.endswith(":") and "(YAML keys" in line]
    assert [h.split(" ")[0] for h in heads] == list(SECTIONS)
    assert text.index("--lr LR") > text.index("optimizer (YAML keys") > text.index("--use_offload, --no_offload")
    words = " ".join(text.split())
    assert "(default: 0.0001; fine_tune.yaml: 0.0003)" in words
    assert "(default: 0; fine_tune.yaml" not in words  # a value equal to the default is not repeated
    assert "fine_tune.yaml" in text.split("options:")[0]  # where a train.sh run's defaults come from


def test_launch_settings_flag_over_environment_over_yaml(tmp_path):
    path = _yaml(tmp_path, "nproc: 4\nmaster_port: 29600\ncuda_visible_devices: '0,1'\n")
    base = ["--config", path]
    assert launch_settings(base, {}) == {"cuda_visible_devices": "0,1", "nproc": 4, "master_port": 29600}
    env = {"NPROC": "3", "MASTER_PORT": "29700", "CUDA_VISIBLE_DEVICES": "2"}
    assert launch_settings(base, env) == {"cuda_visible_devices": None, "nproc": 3, "master_port": 29700}
    flags = ["--nproc", "1", "--master_port", "29611", "--cuda_visible_devices", "3", "--lr", "0.1"]
    assert launch_settings(base + flags, env) == {"cuda_visible_devices": "3", "nproc": 1, "master_port": 29611}
    assert launch_settings(["--config", ""], {}) == {"cuda_visible_devices": None, "nproc": 0, "master_port": 29500}
    for argv, environ, message in ((base, {"NPROC": "two"}, "NPROC='two' must be a whole number"),
                                   (base + ["--nproc", "-1"], {}, r"nproc \(-1\) must be >= 0"),
                                   (base + ["--master_port", "70000"], {}, r"master_port \(70000\) must be a TCP port"),
                                   (base + ["--bogus"], {}, "unrecognized arguments: --bogus")):
        with pytest.raises(ConfigError, match=message):
            launch_settings(argv, environ)


def test_negative_optimizer_values_are_named():
    from pipeline.plan.preflight import check_config

    with pytest.raises(ConfigError, match=r"^weight_decay \(-0.1\) must be >= 0$"):
        check_config(make_config({"weight_decay": -0.1, "device": "cpu"}), 2)
    with pytest.raises(ConfigError, match=r"^lr \(-1.0\) and grad_clip \(-2.0\) must be >= 0$"):
        check_config(make_config({"lr": -1.0, "grad_clip": -2.0, "device": "cpu"}), 2)


def test_a_negative_number_is_a_flags_value():
    """argparse takes "-1e-4" for a flag ("--lr: expected one argument"): here it is lr's value,
    and lr's own rule names it."""
    from pipeline.plan.settings_rules import check_settings

    cfg = parse_args(["--config", "", "--lr", "-1e-4", "--warmup_iterations", "-3", "--seed=-1"])[0]
    assert (cfg.lr, cfg.warmup_iterations, cfg.seed) == (-1e-4, -3, -1)
    with pytest.raises(ConfigError, match=r"^lr \(-0.0001\), warmup_iterations \(-3\) and seed \(-1\) must be >= 0$"):
        check_settings(cfg, 2)


@pytest.mark.parametrize("values,message", [
    ({"batch_size": 0}, r"^batch_size \(0\) must be at least 1$"),
    ({"batch_size": -8}, r"^batch_size \(-8\) must be at least 1$"),
    ({"num_chunks": 0}, r"^num_chunks \(0\) must be at least 1$"),
    ({"batch_size": 0, "num_chunks": 0}, r"^batch_size \(0\) and num_chunks \(0\) must be at least 1$"),
    ({"batch_size": 6}, r"^batch_size \(6\) must be divisible by num_chunks \(4\); e.g. batch_size 8 or num_chunks 3$"),
    ({"adam_beta1": 1.5}, r"^adam_beta1 \(1.5\) must be in \[0, 1\)$"),
    ({"adam_beta2": 1.0}, r"^adam_beta2 \(1.0\) must be in \[0, 1\)$"),
    ({"min_lr_ratio": -1.0}, r"^min_lr_ratio \(-1.0\) must be in \[0, 1\]$"),
    ({"comm_timeout_s": 0.0}, r"^comm_timeout_s \(0.0\) must be > 0$"),
    ({"plan_tflops": 0.0}, r"^plan_tflops \(0.0\) must be > 0$"),
    ({"loss_scale": 0.0}, r"^loss_scale \(0.0\) must be > 0$"),
    ({"mlp_tile_mib": 0.0}, r"^mlp_tile_mib \(0.0\) must be > 0$"),
    ({"num_layers": -2}, r"^num_layers \(-2\) must be >= 0$"),
    ({"optimizer_threads": -1}, r"^optimizer_threads \(-1\) must be >= 0$"),
])
def test_each_message_says_what_is_wrong(values, message):
    """batch_size 0 or -8 was "must be divisible by num_chunks (4)", num_chunks 0 "by num_chunks
    (0)"; out-of-range values that trained into a traceback, a hang or a silent change are named."""
    from pipeline.plan.settings_rules import check_settings

    with pytest.raises(ConfigError, match=message):
        check_settings(make_config(values), 2)


def test_a_yaml_key_given_twice_or_not_utf8_is_one_line(tmp_path):
    """YAML keeps the last of two values of a key without a word; a byte that is not UTF-8 was a
    UnicodeDecodeError traceback. Both are one line naming the file and the lines."""
    path = _yaml(tmp_path, "lr: 1e-4\nbatch_size: 8\nlr: 3e-4\n")
    with pytest.raises(ConfigError, match=rf"^config file '{path}' gives the key 'lr' twice, at lines 1 and 3 "):
        parse_args(["--config", path])
    with pytest.raises(ConfigError, match=r"gives the key 'lr' twice, at lines 2 and 4"):
        parse_args(["--config", _yaml(tmp_path, "optimizer:\n  lr: 1e-4\n  seed: 1\n  lr: 3e-4\n")])
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"seed: 1\nlr: 1e-4  # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^config file '{latin}' is not UTF-8 text: line 2 \(byte 23 of the "
                                          r"file\) holds 0xe9, .*; save the file as UTF-8, e\.g\. "):
        parse_args(["--config", str(latin)])


def test_notes_say_what_the_settings_do_not():
    """A setting given twice on the command line (argparse keeps the last in silence) and a value
    under its older name are notes for the run to print once; the same value twice is none."""
    notes: list[str] = []
    cfg = parse_args(["--config", "", "--lr", "1e-4", "--lr=3e-4", "--use_offload", "--no_offload", "--seed", "1",
                      "--seed", "1", "--mapping", "cross"], notes)[0]
    assert (cfg.lr, cfg.use_offload, cfg.mapping) == (3e-4, False, "planned")
    assert notes == ["the command line sets lr twice (--lr 1e-4, then --lr 3e-4): the last, --lr 3e-4, is used",
                     "the command line sets use_offload twice (--use_offload, then --no_offload): the last, "
                     "--no_offload, is used",
                     "mapping 'cross' is now called 'planned'"]


def test_start_notes_name_slow_cpu_settings_and_figures_not_drawn(monkeypatch):
    """Said once at start-up: a CPU run whose threads are not set (each process then takes every
    core), float16 on the CPU, a warm-up longer than the run, matplotlib not installed (metrics.png
    is not drawn, the run goes on)."""
    import os

    from pipeline.plan import preflight

    cpu, threads = make_config({"device": "cpu"}), {"OMP_NUM_THREADS": "1"}
    cores = len(os.sched_getaffinity(0))
    unset = preflight.start_notes(cpu, 1, environ={})
    if cores > 1:  # one core: nothing to oversubscribe
        assert len(unset) == 1 and unset[0].startswith(f"OMP_NUM_THREADS is not set, so the process runs every "
                                                       f"operation on all {cores} cores"), unset
    assert preflight.start_notes(cpu, 1, environ=threads) == []
    half = preflight.start_notes(make_config({"device": "cpu", "dtype": "float16"}), 2, environ=threads)
    assert len(half) == 1 and half[0].startswith("dtype float16 on the CPU: "), half
    assert preflight.start_notes(make_config({"device": "cpu", "num_iterations": 5, "warmup_iterations": 10}), 2,
                                 environ=threads) == [
        "warmup_iterations (10) > num_iterations (5): the learning rate never reaches lr (0.0001); the last step "
        "runs at 5.00e-05"]
    monkeypatch.setattr(preflight, "installed", lambda package: package != "matplotlib")
    drawn = preflight.start_notes(make_config({"device": "cpu", "timeline": True}), 2, environ=threads)
    assert drawn == ["matplotlib is not installed, so metrics.png and timeline.png will not be drawn; metrics.jsonl "
                     "and timeline.json hold what they would show. python3 -m pip install matplotlib "
                     "(requirements.txt lists it)"]


def test_a_resume_that_stretches_the_schedule_says_so():
    """A 10-step run resumed with num_iterations 14: step 11's lr is the 14-step schedule's
    (7.66e-05 after step 10's 3.00e-05); the same num_iterations or a constant lr say nothing."""
    from pipeline.run.checkpoint import stretched_schedule

    cfg = make_config({"num_iterations": 14, "lr": 3e-4, "warmup_iterations": 2})
    assert stretched_schedule({"num_iterations": 10}, cfg, 10) == (
        "resume: num_iterations 14, the checkpoint's run 10: the cosine learning-rate schedule is stretched over 14 "
        "steps; step 10 ran at lr 3.00e-05, now step 11 runs at 7.66e-05")
    assert "step 7 would have run at 1.35e-04, now step 7 runs at 2.21e-04" in \
        stretched_schedule({"num_iterations": 10}, cfg, 6)
    assert stretched_schedule({"num_iterations": 14}, cfg, 6) is None
    assert stretched_schedule({"num_iterations": 10}, make_config({"num_iterations": 14, "lr_schedule": "constant"}),
                              10) is None


@pytest.mark.parametrize("values,message", [
    ({"batch_size": "eight"}, "must be an integer"),
    ({"use_offload": "yes"}, "must be true or false"),
    ({"schedule": "zigzag"}, "schedule must be one of"),
])
def test_bad_types(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_activation_offload_refuses_what_it_does_not_make_exact():
    from pipeline.plan.preflight import check_config

    with pytest.raises(ConfigError, match=r"keep_layers \(1\) must be 0 or -1"):
        check_config(make_config({"activation_offload": True, "keep_layers": 1, "device": "cpu"}), 2)
    check_config(make_config({"activation_offload": True, "device": "cpu"}), 2)
    # sequence segments: the stash is keyed by segment too, and a segment's recompute attends
    # to the keys/values its earlier segments carried (tests/one_process/test_seq_chunks.py)
    check_config(make_config({"activation_offload": True, "seq_chunks": 2, "device": "cpu"}), 2)


@pytest.mark.parametrize("values,message", [
    ({"device_steps": 1}, r"^device_steps \(1\) needs use_offload without delayed_update or data_parallel; got "
                          r"use_offload off$"),
    ({"use_offload": True, "device_steps": 1, "delayed_update": True, "resident_stages": 0},
     r"got delayed_update$"),
    ({"use_offload": True, "device_steps": 1, "data_parallel": 2, "num_chunks": 4},
     r"got data_parallel 2$"),
    ({"use_offload": True, "device_steps": 3, "resident_stages": 2},
     r"^device_steps \(3\) and resident_stages \(2\) together must be at most the 4 stages per process$"),
    ({"use_offload": True, "device_steps": 1, "lora_rank": 4}, r"^device_steps \(1\) does not apply to lora_rank"),
    ({"device_steps": -1}, r"device_steps.*>= 0"),
])
def test_device_steps_are_refused_where_they_cannot_step_exactly(values, message):
    """device_steps moves an offloaded stage's step to the GPU: nothing to move without offload,
    the replicas' sharded steps and the delayed update stay on the CPU, LoRA's adapters step
    on the GPU already, and there are only so many stages per process."""
    from pipeline.plan.preflight import check_config

    with pytest.raises(ConfigError, match=message):
        check_config(make_config({"num_stages": 8, "device": "cpu", **values}), 2 * values.get("data_parallel", 1))
    check_config(make_config({"num_stages": 8, "device": "cpu", "use_offload": True, "device_steps": 2,
                              "resident_stages": 2}), 2)


@pytest.mark.parametrize("mode", ["resident", "prefetch", "noprefetch", "hybrid", "actoff", "device"])
def test_the_gpu_tests_flags_parse_to_their_settings(mode):
    """The GPU tests build main.py's flags from settings (``tests.helpers.runs.flags``): each mode's
    flags parse back to exactly its settings, so a GPU run cannot die on a misspelt flag before
    training (``activation_offload: False`` once became ``--no_vation_offload``)."""
    from tests.gpu.test_gpu import _settings
    from tests.helpers.runs import flags

    for nproc in (2, 4):
        settings = _settings(nproc, mode)
        cfg, _, _ = parse_args(["--config", "", *flags(settings)])
        assert {k: getattr(cfg, k) for k in settings} == settings
