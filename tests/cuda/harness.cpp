// cellc: runs one generated kernel, compiled as host C++ with the emulation
// header, on buffers read from a job file, and writes every buffer back.
// Built with sanitizers by tests/cuda_sanitized.rs: each buffer is its own
// heap allocation, so AddressSanitizer sees any read or write past one, and
// ThreadSanitizer sees the block's threads race if a barrier is missing.
//
//   harness JOB OUT
//
// JOB (little-endian): u32 name length, name; u32 grid, block, whole, rows,
// k, scratch; u32 buffer count, then per buffer u32 length and the floats;
// u32 table length, then the buffer index of every table entry; with
// whole = 1: u32 sequences, then i32 starts and i32 row counts.
// OUT: u32 buffer count, then per buffer u32 length and the floats.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using cellc_launch_fn = void (*)(unsigned, unsigned, void**);
extern "C" cellc_launch_fn cellc_find_launch(const char* name);

static FILE* job;
static unsigned u32() {
    unsigned v = 0;
    if (std::fread(&v, 4, 1, job) != 1) { std::fprintf(stderr, "harness: truncated job\n"); std::exit(2); }
    return v;
}

int main(int argc, char** argv) {
    if (argc != 3) { std::fprintf(stderr, "usage: harness JOB OUT\n"); return 2; }
    job = std::fopen(argv[1], "rb");
    if (!job) { std::perror(argv[1]); return 2; }
    std::string name(u32(), '\0');
    if (std::fread(name.data(), 1, name.size(), job) != name.size()) return 2;
    const unsigned grid = u32(), block = u32(), whole = u32(), rows = u32(), k = u32(), scratch_len = u32();
    std::vector<float*> buffers(u32());
    std::vector<unsigned> lengths(buffers.size());
    for (size_t b = 0; b < buffers.size(); ++b) {
        lengths[b] = u32();
        buffers[b] = new float[lengths[b]];
        if (std::fread(buffers[b], 4, lengths[b], job) != lengths[b]) return 2;
    }
    std::vector<float*> table(u32());
    for (auto& entry : table) entry = buffers.at(u32());
    if (table.size() != size_t(rows) * k) { std::fprintf(stderr, "harness: table size\n"); return 2; }
    float* scratch = new float[size_t(grid) * (scratch_len ? scratch_len : 1)];
    cellc_launch_fn launch = cellc_find_launch(name.c_str());
    if (!launch) { std::fprintf(stderr, "harness: no kernel %s\n", name.c_str()); return 2; }
    float** args_ptr = table.data();
    int n_rows = int(rows);
    if (whole) {
        const unsigned n = u32();
        int* starts = new int[n];
        int* counts = new int[n];
        for (unsigned s = 0; s < n; ++s) starts[s] = int(u32());
        for (unsigned s = 0; s < n; ++s) counts[s] = int(u32());
        int sequences = int(n);
        void* args[] = {&args_ptr, &starts, &counts, &sequences, &scratch};
        launch(grid, block, args);
        delete[] starts;
        delete[] counts;
    } else {
        void* args[] = {&args_ptr, &n_rows, &scratch};
        launch(grid, block, args);
    }
    std::fclose(job);
    FILE* out = std::fopen(argv[2], "wb");
    if (!out) { std::perror(argv[2]); return 2; }
    const unsigned count = unsigned(buffers.size());
    std::fwrite(&count, 4, 1, out);
    for (size_t b = 0; b < buffers.size(); ++b) {
        std::fwrite(&lengths[b], 4, 1, out);
        std::fwrite(buffers[b], 4, lengths[b], out);
        delete[] buffers[b];
    }
    delete[] scratch;
    std::fclose(out);
    return 0;
}
