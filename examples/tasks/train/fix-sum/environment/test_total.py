from total import sum_to

assert sum_to(1) == 1
assert sum_to(4) == 10
assert sum_to(100) == 5050
print('ok')
