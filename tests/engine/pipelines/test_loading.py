"""Loading a folder component by component: progress lines, quiet library
bars, and the logging specs that make those lines visible."""

from __future__ import annotations

import logging

import pytest

from diffrt.engine.models import loading
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.pipelines.load import load_pipeline


def _progress(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == loading.PROGRESS_LOGGER]


def test_components_are_listed_in_index_order_with_their_sizes():
    folder = embedded_folder("tiny-sd3")
    parts = loading.weight_components(folder)
    assert [p[0] for p in parts] == ["text_encoder", "text_encoder_2", "text_encoder_3",
                                     "transformer", "vae"]
    assert all(size > 0 for *_, size in parts)
    assert loading.format_bytes(33_100_000_000) == "33.1 GB"
    assert loading.format_bytes(999) == "999 B"


def test_a_large_checkpoint_reports_each_component_at_info(monkeypatch, caplog):
    from diffusers.utils import logging as diffusers_logging

    monkeypatch.setattr(loading, "PROGRESS_BYTES", 1)
    caplog.set_level(logging.DEBUG, logger=loading.PROGRESS_LOGGER)
    load_pipeline(embedded_folder("tiny-flux"))
    lines = _progress(caplog)
    assert all(level == logging.INFO for level, _ in lines)
    text = [m for _, m in lines]
    assert "4 components with weights" in text[0]
    assert any(m.startswith("[2/4] text_encoder_2 (T5EncoderModel,") for m in text)
    assert any(m.startswith("[3/4] transformer loaded in") for m in text)
    assert text[-1].startswith("loaded ")
    assert diffusers_logging.is_progress_bar_enabled()  # restored after loading


def test_a_small_checkpoint_reports_at_debug_only(caplog):
    caplog.set_level(logging.DEBUG, logger=loading.PROGRESS_LOGGER)
    load_pipeline("tiny-flux")
    assert _progress(caplog) and {level for level, _ in _progress(caplog)} == {logging.DEBUG}


@pytest.mark.parametrize(("spec", "root", "load"), [
    ("WARNING", logging.WARNING, logging.NOTSET),
    ("warning,diffrt.load=INFO", logging.WARNING, logging.INFO),
    ("DEBUG, diffrt.load=info", logging.DEBUG, logging.INFO),
    ("diffrt.load=DEBUG", logging.WARNING, logging.DEBUG),  # pairs only: root stays WARNING
    ("WARNING,diffrt.load=INFO", logging.WARNING, logging.INFO),  # DEFAULT_LOG_SPEC
])
def test_worker_log_spec(monkeypatch, spec, root, load):
    from diffrt.runtime.worker import configure_logging

    root_logger = logging.getLogger()
    monkeypatch.setattr(root_logger, "handlers", [])  # let basicConfig act, then restore
    monkeypatch.setattr(root_logger, "level", root_logger.level)
    target = logging.getLogger("diffrt.load")
    monkeypatch.setattr(target, "level", target.level)
    target.setLevel(logging.NOTSET)
    configure_logging(spec)
    assert root_logger.level == root and target.level == load


def test_the_cli_and_the_workers_show_the_progress_logger():
    from diffrt.cli import PROGRESS_LOGGERS
    from diffrt.cli.engine_opts import engine_settings, worker_log_spec
    from diffrt.runtime.worker import DEFAULT_LOG_SPEC

    assert loading.PROGRESS_LOGGER in PROGRESS_LOGGERS
    assert f"{loading.PROGRESS_LOGGER}=INFO" in DEFAULT_LOG_SPEC
    assert worker_log_spec("DEBUG") == "DEBUG,diffrt.load=DEBUG"
    settings = engine_settings({"model": "tiny-flux", "log_level": "INFO"})
    assert settings["worker_env"] == {"DIFFRT_LOG_LEVEL": "INFO,diffrt.load=INFO"}
    assert "worker_env" not in engine_settings({"model": "tiny-flux", "log_level": "WARNING"})


def test_variant_and_pickle_duplicates_are_not_counted(tmp_path):
    sub = tmp_path / "transformer"
    sub.mkdir()
    for name, size in [("diffusion_pytorch_model.safetensors", 100),
                       ("diffusion_pytorch_model.fp16.safetensors", 50),
                       ("diffusion_pytorch_model.bin", 100),
                       ("model.fp16-00001-of-00002.safetensors", 25), ("config.json", 10)]:
        (sub / name).write_bytes(b"x" * size)
    assert loading.component_bytes(str(tmp_path), "transformer") == 100
    (sub / "diffusion_pytorch_model.safetensors").unlink()
    assert loading.component_bytes(str(tmp_path), "transformer") == 100  # the pickle then
