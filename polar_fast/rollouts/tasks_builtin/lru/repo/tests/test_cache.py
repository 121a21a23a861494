import unittest

from lrucache import LRUCache


class TestLRU(unittest.TestCase):
    def test_evicts_oldest(self):
        c = LRUCache(2)
        c.put("a", 1)
        c.put("b", 2)
        c.put("c", 3)
        self.assertIsNone(c.get("a"))
        self.assertEqual(len(c), 2)

    def test_default(self):
        self.assertEqual(LRUCache(1).get("x", 7), 7)
