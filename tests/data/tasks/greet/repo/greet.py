"""The fixture repo of tests/test_tasks_validate.py run with django's test spec."""


def hello(name):
    return "Hello " + name


def shout(text):
    return text.upper()
