"""The consumer side's core: inbox claim + effect in one transaction, delivery counts, dead letters, ordering."""
