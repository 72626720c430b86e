"""Domain types and rules; imports nothing from storage or http."""
