// cellc: replays one step-loop launch the emulated device recorded
// (runtime/src/backend/cuda/recorder.rs), built together with the module's
// emulation source, and writes every block of memory back. Built with
// sanitizers by tests/cuda_sanitized.rs: each block of device memory is its
// own heap allocation, so AddressSanitizer sees any access past one, and
// ThreadSanitizer sees the grid's threads race if a barrier is missing.
//
//   step_loop_harness IMAGE OUT
//
// OUT: u64 block count, then per block u64 bytes and its bytes (padded to 8).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using cellc_launch_grid_fn = void (*)(unsigned, unsigned, unsigned, void**);
extern "C" cellc_launch_grid_fn cellc_find_launch_grid(const char* name);

static FILE* image;
static uint64_t word() {
    uint64_t v = 0;
    if (std::fread(&v, 8, 1, image) != 1) { std::fprintf(stderr, "harness: truncated image\n"); std::exit(2); }
    return v;
}
static std::vector<char> padded(uint64_t bytes) {
    std::vector<char> b((bytes + 7) / 8 * 8);
    if (!b.empty() && std::fread(b.data(), 1, b.size(), image) != b.size()) std::exit(2);
    return b;
}

struct Block {
    uint64_t addr, bytes;
    bool addresses;
    char* memory;
};

int main(int argc, char** argv) {
    if (argc != 3) { std::fprintf(stderr, "usage: step_loop_harness IMAGE OUT\n"); return 2; }
    image = std::fopen(argv[1], "rb");
    if (!image) { std::perror(argv[1]); return 2; }
    padded(word());  // the module's file name
    const uint64_t name_len = word();
    std::vector<char> name = padded(name_len);
    const std::string kernel(name.data(), name_len);
    const unsigned grid = unsigned(word()), block = unsigned(word()), shared = unsigned(word());
    std::vector<uint64_t> args(word());
    for (auto& a : args) a = word();
    std::vector<Block> blocks(word());
    for (auto& b : blocks) {
        b.addr = word();
        b.bytes = word();
        b.addresses = word() != 0;
        b.memory = new char[b.bytes ? b.bytes : 1];
        std::vector<char> content = padded(b.bytes);
        if (b.bytes) std::memcpy(b.memory, content.data(), b.bytes);
    }
    std::fclose(image);
    // A recorded address inside a block points into that block's copy.
    auto relocate = [&](uint64_t w) {
        for (const auto& b : blocks)
            if (b.bytes && w >= b.addr && w < b.addr + b.bytes) return uint64_t(uintptr_t(b.memory)) + (w - b.addr);
        return w;
    };
    for (auto& b : blocks) {
        if (!b.addresses) continue;
        for (uint64_t at = 0; at + 8 <= b.bytes; at += 8) {
            uint64_t w;
            std::memcpy(&w, b.memory + at, 8);
            w = relocate(w);
            std::memcpy(b.memory + at, &w, 8);
        }
    }
    for (auto& a : args) a = relocate(a);
    cellc_launch_grid_fn launch = cellc_find_launch_grid(kernel.c_str());
    if (!launch) { std::fprintf(stderr, "harness: no step loop %s\n", kernel.c_str()); return 2; }
    std::vector<void*> slots(args.size());
    for (size_t i = 0; i < args.size(); ++i) slots[i] = &args[i];
    launch(grid, block, shared, slots.data());
    FILE* out = std::fopen(argv[2], "wb");
    if (!out) { std::perror(argv[2]); return 2; }
    const uint64_t n = blocks.size();
    std::fwrite(&n, 8, 1, out);
    for (auto& b : blocks) {
        std::fwrite(&b.bytes, 8, 1, out);
        std::vector<char> content((b.bytes + 7) / 8 * 8, 0);
        if (b.bytes) std::memcpy(content.data(), b.memory, b.bytes);
        std::fwrite(content.data(), 1, content.size(), out);
        delete[] b.memory;
    }
    std::fclose(out);
    return 0;
}
