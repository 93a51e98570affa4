"""Small per-token / quadratic references for the ops, used only by the tests."""
