# placeholder owned by the bench work: defines bench()
