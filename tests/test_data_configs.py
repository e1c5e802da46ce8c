"""Every paper config under configs/<paper>/ parses with the CLI's parser (class paths resolve, init_args match the
signatures), and every *_cpu config that needs no download trains one round that changes the global model."""

import glob
import importlib
import os

import pytest
import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPERS = ("fedexpsls", "fedsps", "fedli", "feddane", "kdecay")
CONFIGS = sorted(p for paper in PAPERS for p in glob.glob(os.path.join(ROOT, "configs", paper, "*.yaml")))
CPU_CONFIGS = [p for p in CONFIGS if p.endswith("_cpu.yaml")]
OFFLINE_DATA = {"DigitsDataModule", "ShakespeareDataModule", "SyntheticDataModule"}


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _class_paths(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "class_path":
                yield v
            else:
                yield from _class_paths(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _class_paths(v)


def _missing_classes(path: str):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    missing = []
    for cp in _class_paths(cfg):
        module, _, name = cp.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            missing.append(cp)
    return cfg, missing


@pytest.fixture(scope="module")
def parser():
    from fedlightning.cli import FederatedCLI

    cli = FederatedCLI(
        args=["--config", os.path.join(ROOT, "configs", "quickstart.yaml"), "--trainer.logger", "false"], run=False
    )
    return cli.parser


def test_every_paper_has_configs():
    for paper in PAPERS:
        names = [os.path.basename(p) for p in CONFIGS if os.sep + paper + os.sep in p]
        assert any(not n.endswith("_cpu.yaml") for n in names), f"configs/{paper} has no paper config"
        assert any(n.endswith("_cpu.yaml") for n in names), f"configs/{paper} has no *_cpu config"


@pytest.mark.parametrize("path", CONFIGS, ids=_rel)
def test_config_parses(path, parser, capsys):
    cfg, missing = _missing_classes(path)
    if missing:
        pytest.skip(f"classes not implemented yet: {missing}")
    try:
        ns = parser.parse_args(["--config", path])
    except SystemExit:  # jsonargparse reports the error on stderr and exits
        pytest.fail(f"{_rel(path)} does not parse:\n{capsys.readouterr().err[-3000:]}")
    # the parsed values are the file's values (not defaults silently taking over)
    assert (ns.model.local_steps, ns.model.local_epochs) == (
        cfg["model"].get("local_steps"),
        cfg["model"].get("local_epochs"),
    )
    assert (ns.model.local_steps is None) != (ns.model.local_epochs is None)  # one of the two, never both
    assert ns.model.clients_per_round == cfg["model"]["clients_per_round"]
    assert ns.trainer.max_steps == cfg["trainer"]["max_steps"]
    # a config is run as `python train.py fit --config <its path>`: its header says so
    with open(path) as f:
        assert f"--config {_rel(path)}" in f.read()
    num_clients = cfg["data"].get("init_args", {}).get("num_clients")
    if num_clients is not None:
        assert cfg["model"]["clients_per_round"] <= num_clients


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=_rel)
def test_cpu_config_trains_one_round(path, tmp_path):
    cfg, missing = _missing_classes(path)
    if missing:
        pytest.skip(f"classes not implemented yet: {missing}")
    if cfg["data"]["class_path"].rsplit(".", 1)[-1] not in OFFLINE_DATA:
        pytest.skip("needs downloaded data")
    from fedlightning.cli import main

    args = [
        "--config",
        path,
        "--trainer.max_steps",
        "1",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        # keeps the test fast (the configured rounds are much larger): 2 local steps, or a tenth of an epoch
        *(["--model.local_steps", "2"] if "local_epochs" not in cfg["model"] else ["--model.local_epochs", "0.1"]),
        "--model.clients_per_round",
        "2",
    ]
    cli = main(args, run=False)
    loop = cli.model
    before = torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach().clone()
    cli.trainer.fit(loop, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    after = torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach()
    assert torch.isfinite(after).all()
    assert not torch.equal(before, after), "one round left the global model unchanged"


def test_config_tables_list_every_config_and_every_link_resolves():
    """docs/configs.md lists every config of configs/ (paper configs and single-algorithm configs, not sweeps),
    every link to a config exists, the stated counts are right, and the README links the page."""
    import re

    with open(os.path.join(ROOT, "docs", "configs.md"), encoding="utf-8") as f:
        page = f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "](docs/configs.md)" in f.read()
    linked = [os.path.normpath(os.path.join("docs", p)) for p in re.findall(r"\]\((\.\./configs/[^)]+\.yaml)\)", page)]
    missing_files = [p for p in linked if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing_files, f"docs/configs.md links to configs that do not exist: {missing_files}"
    every = {_rel(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))} | {_rel(p) for p in CONFIGS}
    every.discard(os.path.join("configs", "quickstart_wandb.yaml"))  # a logging variant of the quickstart
    unlisted = sorted(every - set(linked))
    assert not unlisted, f"configs missing from the docs/configs.md tables: {unlisted}"
    count = re.search(r"(\d+) configs in all \((\d+) `\*_cpu`\)", page)
    assert count and (int(count.group(1)), int(count.group(2))) == (len(CONFIGS), len(CPU_CONFIGS))


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.endswith("_fedlils.yaml")], ids=_rel)
def test_seed_002_line_search_starts_at_one_and_grows_to_the_cap(path):
    """Seed 002's reference code: first trial step init_step_size = 1, grown by γ = 2 per local epoch, capped at
    eta_max = 10 here (its theory's η ∈ (0, η_max]). The config's client optimizer on f = ½·0.05·w² (Armijo holds
    for every η ≤ 36), one batch per epoch, takes 1, 2, 4, 8, 10, 10."""
    from fedlightning.optim import SgdArmijo

    with open(path) as f:
        spec = yaml.safe_load(f)["model"]["client_optimizer"]
    assert spec["class_path"] == "fedlightning.optim.SgdArmijo"
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = SgdArmijo([w], **spec["init_args"], n_batches_per_epoch=1)
    steps = []
    for _ in range(6):
        opt.zero_grad()
        opt.step(lambda: 0.025 * (w * w).sum())
        steps.append(opt.last_step["step_size"])
    assert steps == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


@pytest.mark.parametrize("path", [p for p in CONFIGS if os.sep + "feddane" + os.sep in p], ids=_rel)
def test_seed_003_configs_log_the_global_training_loss(path):
    """Seed 003 plots the global model's training loss over all devices; train/loss is the mean of the clients'
    objectives (with FedProx's and FedDANE's terms). Every seed 003 config evaluates the global model on the
    clients' training data (train_eval/loss) at each validation."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    evaluations = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("GlobalEvaluation")]
    assert len(evaluations) == 1
    args = evaluations[0].get("init_args", {})
    assert args.get("split", "train") == "train"
    assert args["every_n_rounds"] == cfg["trainer"]["val_check_interval"]
