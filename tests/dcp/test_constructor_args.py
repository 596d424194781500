"""One way into each constructor (issue 36): ``TieredWriter`` and ``TieredReader`` take the
tiers as ``hot``/``cold`` URLs or one ``Store``, what they work on, and one options object;
``FileSystemWriter``'s and ``FileSystemReader``'s own arguments as DCP does. The keywords
tierstore took before its first release are ``TypeError``s naming what to write instead."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from tierstore import ConfigError, ReaderOptions, Store, TieredReader, TieredWriter, WriterOptions


@pytest.mark.parametrize("cls", [TieredWriter, TieredReader])
def test_a_constructor_has_at_most_ten_parameters(cls: type) -> None:
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert len(params) <= 10, params
    assert params[:2] == ["hot", "cold"]
    assert not {"path", "hot_options", "cold_options", "node_local"} & set(params)


STORE = "(Store.of(hot, cold, {name}=...), ...): a Store holds its tiers' options"
WRITER_OLD = [
    ("hot_options", {"fsync": True}, "TieredWriter" + STORE),
    ("cold_options", {"fsync": True}, "TieredWriter" + STORE),
    ("node_local", True, "TieredWriter" + STORE),
    ("encoding", "dcp", "TieredWriter(..., options=WriterOptions({name}=...))"),
    ("manifest_part_ranks", 3, "TieredWriter(..., options=WriterOptions({name}=...))"),
    ("max_files_per_dir", 5, "TieredWriter(..., options=WriterOptions({name}=...))"),
]
READER_OLD = [
    ("hot_options", {"fsync": True}, "TieredReader" + STORE),
    ("cold_options", {"fsync": True}, "TieredReader" + STORE),
    ("node_local", True, "TieredReader" + STORE),
    ("thread_count", 2, "TieredReader(..., options=ReaderOptions({name}=...))"),
    ("lease", False, "TieredReader(..., options=ReaderOptions({name}=...))"),
    ("resolve_once", True, "TieredReader(..., options=ReaderOptions({name}=...))"),
]


@pytest.mark.parametrize("name, value, instead", WRITER_OLD, ids=[c[0] for c in WRITER_OLD])
def test_an_old_writer_keyword_is_a_type_error_naming_the_new_form(
    tmp_path: Path, name: str, value: Any, instead: str
) -> None:
    said = f"TieredWriter() no longer takes {name}=: pass {instead.format(name=name)}"
    with pytest.raises(TypeError, match=re.escape(said)):
        TieredWriter(str(tmp_path / "hot"), step=1, **{name: value})
    assert not (tmp_path / "hot").exists()


@pytest.mark.parametrize("name, value, instead", READER_OLD, ids=[c[0] for c in READER_OLD])
def test_an_old_reader_keyword_is_a_type_error_naming_the_new_form(
    tmp_path: Path, name: str, value: Any, instead: str
) -> None:
    said = f"TieredReader() no longer takes {name}=: pass {instead.format(name=name)}"
    with pytest.raises(TypeError, match=re.escape(said)):
        TieredReader(str(tmp_path / "hot"), **{name: value})


def test_an_unknown_keyword_is_pythons_type_error(tmp_path: Path) -> None:
    for build in (TieredWriter, TieredReader):
        with pytest.raises(TypeError, match="got an unexpected keyword argument 'no_such'"):
            build(str(tmp_path), no_such=1)


def test_the_tiers_are_urls_a_path_or_one_store(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    assert [t.url for t in TieredWriter(hot, cold, step=1).tiers] == [t.url for t in Store(hot, cold).tiers]
    assert TieredWriter(path=hot, step=1).hot.url == TieredWriter(hot, step=1).hot.url  # DCP's name
    assert TieredReader(path=hot).tiers[0].url == TieredReader(hot).tiers[0].url
    local = Store.of(hot, cold, node_local=True)
    assert TieredWriter(local, step=1).node_local and TieredReader(local).node_local
    for build in (lambda: TieredWriter(hot, path=hot, step=1), lambda: TieredReader(hot, path=hot)):
        with pytest.raises(ConfigError, match="got both hot and path="):
            build()
    with pytest.raises(ConfigError, match="either a Store or tier URLs"):
        TieredReader(local, cold)


def test_the_options_objects_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"TieredReader\(options=\) takes a ReaderOptions"):
        TieredReader(str(tmp_path), options=WriterOptions())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"TieredWriter\(options=\) takes a WriterOptions"):
        TieredWriter(str(tmp_path), step=1, options=ReaderOptions())  # type: ignore[arg-type]
