// One part of the instantiations common/json.h declares (see there).
#define FMOE_JSON_INSTANTIATE FMOE_JSON_PART_ORDERED
#include "common/json.h"
