#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/kestrel/d' nectar.txt
