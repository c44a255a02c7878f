"""Test-wide settings."""

import os

# Mooncake's transfer engine logs every segment it opens and closes through glog; keep warnings.
os.environ.setdefault("GLOG_minloglevel", "1")
