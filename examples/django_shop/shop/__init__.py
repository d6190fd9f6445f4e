"""The example shop app: orders placed with their OrderPlaced event, and a Django consumer."""
