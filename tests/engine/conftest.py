from __future__ import annotations

import pytest

from tests.engine.checkpoints import make_synth_tiny, save_hf


@pytest.fixture(scope="session")
def synth_tiny(tmp_path_factory):
    return make_synth_tiny(tmp_path_factory)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return save_hf("qwen3-gqa-norm", tmp_path_factory.mktemp("hf") / "qwen3")


@pytest.fixture
def ft_log(caplog):
    """The ft logger does not propagate: attach caplog's handler to it directly."""
    import logging

    logger = logging.getLogger("ft")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="ft")
    yield caplog
    logger.removeHandler(caplog.handler)
