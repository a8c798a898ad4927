# placeholder owned by the API work: defines serve()
