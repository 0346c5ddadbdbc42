"""This folder is test data of nanfuzz's own suite (tests/test_example_repo.py runs it
as a repository of its own).  It collects its tests only when it is pytest's root,
so nanfuzz's own test run leaves them alone."""
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path, config):
    if config.rootpath.resolve() != HERE:
        return True
    return None
