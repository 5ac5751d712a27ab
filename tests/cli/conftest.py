from __future__ import annotations

import pytest

from tests.engine.checkpoints import make_synth_tiny


@pytest.fixture(scope="session")
def synth_tiny(tmp_path_factory):
    return make_synth_tiny(tmp_path_factory)
