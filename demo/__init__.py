"""`grayguard demo`: the whole system catching a gray failure on the local stack, with a live view and a report."""
