"""A tiny calculator: the fixture repo of tests/test_tasks_validate.py."""


def add(a, b):
    return a - b


def mul(a, b):
    return a * b
