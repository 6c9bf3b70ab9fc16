#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'nectar ember' >> basil.txt
