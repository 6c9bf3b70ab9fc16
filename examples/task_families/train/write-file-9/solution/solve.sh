#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'juniper orchid' > apple.txt
