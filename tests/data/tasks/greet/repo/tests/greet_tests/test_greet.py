import unittest

from greet import shout


class GreetTests(unittest.TestCase):
    def test_shout(self):
        self.assertEqual(shout("hi"), "HI")
