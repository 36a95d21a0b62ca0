"""Op implementations: a pure-torch reference per op, faster ones selected by capability."""
