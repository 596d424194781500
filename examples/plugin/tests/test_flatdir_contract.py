import pytest

from tierstore.testing import BackendContract
from tierstore_flatdir import FlatDirBackend


class TestFlatDir(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path):
        return FlatDirBackend(f"flatdir://{tmp_path}")
