"""An in-memory ledger of account balances (integer cents)."""


class InsufficientFunds(Exception):
    pass


class Ledger:
    def __init__(self, balances=None):
        self.balances = dict(balances or {})

    def deposit(self, account, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balances[account] = self.balances.get(account, 0) + amount

    def transfer(self, source, target, amount):
        if amount <= 0:
            raise ValueError("transfer must be positive")
        self.balances[source] = self.balances.get(source, 0) - amount
        self.balances[target] = self.balances.get(target, 0) + amount
