import pytest

from tests.passes.helpers import TextSnapshot


@pytest.fixture
def text_snapshot(snapshot):
    return snapshot.use_extension(TextSnapshot)
