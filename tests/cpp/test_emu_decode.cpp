#include "test_emu.h"
namespace emu_test {
void decode_cases() {}
}
