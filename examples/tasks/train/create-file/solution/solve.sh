#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'hello world' > hello.txt
