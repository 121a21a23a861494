import unittest

from ledger import Ledger


class TestLedger(unittest.TestCase):
    def test_deposit(self):
        book = Ledger()
        book.deposit("alice", 100)
        self.assertEqual(book.balances, {"alice": 100})

    def test_transfer(self):
        book = Ledger({"alice": 100})
        book.transfer("alice", "bob", 40)
        self.assertEqual(book.balances, {"alice": 60, "bob": 40})
