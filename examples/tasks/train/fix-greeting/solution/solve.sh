#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/Helo,/Hello,/' greet.py
