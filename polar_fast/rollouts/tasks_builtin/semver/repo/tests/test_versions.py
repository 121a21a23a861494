import unittest

from versions import is_newer, parse


class TestVersions(unittest.TestCase):
    def test_simple(self):
        self.assertTrue(is_newer("1.2.4", "1.2.3"))
        self.assertFalse(is_newer("1.2.3", "1.2.3"))

    def test_invalid(self):
        with self.assertRaises(ValueError):
            parse("1.x")
