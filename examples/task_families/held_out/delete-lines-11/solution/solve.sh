#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/cobalt/d' iris.txt
