import pytest
from tierstore_flatdir import FlatDirBackend

from tierstore.testing import BackendContract


class TestFlatDir(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path):
        return FlatDirBackend(f"flatdir://{tmp_path}")
